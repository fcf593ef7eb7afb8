"""``ztate verify --bundle --jobs N``: records.jsonl cut into byte ranges at thread
boundaries, each range read and verified by a worker process of its own.

What must hold: the findings of one process (line numbers, checkpoints, the order
of thread groups across ranges), a file that changes while the workers read it
gives no verdict, and threads out of order are a ``bundle.order`` finding either
way. The workers are real forked processes reading the real file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tests.unit.test_verify_bundle import (
    APPROVAL_KEY,
    KEYRING,
    POLICIES,
    T0,
    Chain,
    honest_chain,
)
from ztate.contract.canonical import sha256_hex
from ztate.contract.checkpoints import sign_checkpoint
from ztate.services.verify import bundle, parallel
from ztate.services.verify.bundle import (
    BUNDLE_ORDER,
    CHECKPOINTS,
    MANIFEST,
    RECORDS,
    BundleWriter,
    verify_bundle,
)
from ztate.services.verify.checks import Finding, Summary, Trust, VerifyError
from ztate.services.verify.parallel import verify_bundle_parallel

CHECKPOINT_KEY = Ed25519PrivateKey.generate()
APPROVALS = {"approval-k1": APPROVAL_KEY.public_key()}
TRUST = Trust(KEYRING, APPROVALS, POLICIES, {"cp-k1": CHECKPOINT_KEY.public_key()})
THREADS = [f"t-{number:02d}" for number in range(12)]
REPO = Path(__file__).resolve().parents[2]


def write(folder: Path, chains: list[Chain], checkpoints: dict[str, dict[int, str]]) -> Path:
    """A bundle of ``chains`` (in the order given) and signed heads (thread -> version
    -> the head digest signed)."""
    with BundleWriter(folder) as writer:
        for chain in chains:
            for row in chain.rows:
                writer.add(row)
        for thread_id in sorted(checkpoints):
            for version, head in sorted(checkpoints[thread_id].items()):
                signed = sign_checkpoint(
                    CHECKPOINT_KEY,
                    "cp-k1",
                    thread_id=thread_id,
                    version=version,
                    head_digest=head,
                    signed_at=T0,
                )
                writer.add_checkpoint(thread_id, version, signed)
        writer.finish({c.thread_id: (c.rows[-1].version, c.rows[-1].digest) for c in chains})
    return folder


def rewrite(folder: Path, lines: list[bytes]) -> None:
    """records.jsonl as ``lines``, the manifest's packing list made to match (an
    attacker who rewrites both)."""
    data = b"".join(lines)
    (folder / RECORDS).write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(records_sha256=sha256_hex(data), records=len(lines))
    (folder / MANIFEST).write_text(json.dumps(manifest))


def both(folder: Path, jobs: int, trust: Trust = TRUST) -> tuple[list[Finding], list[Finding]]:
    """The findings of one process and of ``jobs`` workers, with equal summaries."""
    one: list[Finding] = []
    alone = verify_bundle(folder, trust, one.append)
    many: list[Finding] = []
    together = verify_bundle_parallel(folder, trust, many.append, jobs=jobs)
    assert together == alone
    return one, many


def cuts(folder: Path, jobs: int) -> list[tuple[int, str]]:
    path = folder / RECORDS
    with path.open("rb") as handle:
        return parallel._cuts(handle, path.stat().st_size, jobs)


def ordered(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (f.thread_id or "", f.version or -1, f.check, f.found))


def tampered_bundle(folder: Path) -> Path:
    """Twelve threads, with a finding of every kind a range boundary could disturb."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    signed = {
        "t-01": {3: chains[1].rows[3].digest},  # a signed head the chain passes through
        "t-04": {1: chains[4].rows[2].digest},  # a signed head of another record
        "t-05x": {0: chains[5].rows[0].digest},  # a thread with no records at all
        "t-08": {2: chains[8].rows[2].digest, 9: "0" * 64},  # 9: beyond the last record
        "t-11": {3: chains[11].rows[3].digest},
    }
    write(folder, chains, signed)
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    row = json.loads(lines[9])  # t-02 version 1
    row["signature"] = "0" * 64
    lines[9] = json.dumps(row, separators=(",", ":")).encode() + b"\n"
    lines[26] = lines[26][: lines[26].index(b',"digest"')] + b",broken\n"  # t-06 version 2
    del lines[37]  # t-09 version 1
    rewrite(folder, lines)
    return folder


@pytest.mark.parametrize("jobs", [2, 3, 5])
def test_ranges_find_exactly_what_one_process_finds(tmp_path: Path, jobs: int) -> None:
    folder = tampered_bundle(tmp_path / "bundle")
    # the file is cut: every worker has a range
    assert len(cuts(folder, jobs)) == jobs - 1

    one, many = both(folder, jobs)

    assert ordered(many) == ordered(one)
    found = {(f.thread_id, f.version, f.check) for f in one}
    assert {
        ("t-02", 1, "signature"),
        (None, None, "bundle.line"),  # line 27, the file's number in every range
        ("t-04", 1, "checkpoint"),
        ("t-05x", 0, "checkpoint"),
        ("t-08", 9, "checkpoint"),
        ("t-09", 1, "version"),
    } <= found
    assert [f.found for f in many if f.check == "bundle.line"] == ["line 27: not JSON"]


def test_an_honest_bundle_in_ranges_verifies(tmp_path: Path) -> None:
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {"t-07": {3: chains[7].rows[3].digest}})
    one, many = both(folder, 4)
    assert one == many == []


@pytest.mark.parametrize("jobs", [1, 3])
def test_threads_out_of_code_point_order_are_a_bundle_order_finding(
    tmp_path: Path, jobs: int
) -> None:
    """The exporter writes threads in code point order, which the checkpoints are
    merged by: a thread that comes after a greater one is reported, in one process
    and across ranges alike."""
    chains = [honest_chain(thread_id) for thread_id in ("t-00", "t-01", "t-03", "t-02", "t-04")]
    folder = write(tmp_path / "bundle", chains, {})
    findings: list[Finding] = []
    if jobs == 1:
        verify_bundle(folder, TRUST, findings.append)
    else:
        verify_bundle_parallel(folder, TRUST, findings.append, jobs=jobs)
    assert [(f.thread_id, f.version, f.check, f.found) for f in findings] == [
        ("t-02", 0, BUNDLE_ORDER, "the thread's lines come after those of thread t-03")
    ]


class RewrittenInAWorker(Mapping[str, Ed25519PublicKey]):
    """The approval keys; the first lookup in a worker (at its first record with a
    receipt) changes one byte of a signature in ``path`` in place (the first
    signature, or the ``last``), as a process writing to the bundle while it is
    verified would: ``before`` runs first, ``after`` once the byte is written."""

    def __init__(
        self,
        path: Path,
        *,
        last: bool = False,
        before: Callable[[], object] = lambda: None,
        after: Callable[[], object] = lambda: None,
    ) -> None:
        self._path, self._leader, self._before, self._after = path, os.getpid(), before, after
        data = path.read_bytes()
        find = data.rindex if last else data.index
        self._at = find(b'"signature":"') + len(b'"signature":"')
        # every worker writes the same byte, never the one the file held
        self._byte = b"0" if data[self._at : self._at + 1] != b"0" else b"1"
        self._done = False

    def __getitem__(self, key_id: str) -> Ed25519PublicKey:
        if os.getpid() != self._leader and not self._done:
            self._done = True
            self._before()
            with self._path.open("r+b") as handle:
                handle.seek(self._at)
                handle.write(self._byte)
            self._after()
        return APPROVALS[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(APPROVALS)

    def __len__(self) -> int:
        return len(APPROVALS)


def test_a_bundle_that_changes_while_workers_read_it_gives_no_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader hashed the file before the change; the last range's worker, reading
    in small blocks, reads the change."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {"t-00": {1: chains[0].rows[1].digest}})
    monkeypatch.setattr(parallel, "BLOCK", 256)  # workers read lazily, in small blocks
    read_done, tell = os.pipe()
    hand_out = parallel._hand_out

    def hand_out_then_tell(*args: Any) -> Any:
        handed = hand_out(*args)
        os.write(tell, b"xx")  # one byte for each worker
        return handed

    monkeypatch.setattr(parallel, "_hand_out", hand_out_then_tell)
    # the last line's signature, once the leader has read the whole file (a byte on
    # read_done)
    keys = RewrittenInAWorker(folder / RECORDS, last=True, before=lambda: os.read(read_done, 1))
    trust = Trust(KEYRING, keys, POLICIES, {"cp-k1": CHECKPOINT_KEY.public_key()})
    findings: list[Finding] = []
    try:
        with pytest.raises(VerifyError) as stopped:
            verify_bundle_parallel(folder, trust, findings.append, jobs=2)
    finally:
        os.close(read_done)
        os.close(tell)

    assert str(stopped.value) == (
        f"{folder / RECORDS} changed while it was verified (worker 2 of 2 read other "
        "bytes than the leader): the ledger is NOT verified; verify a copy nothing writes to"
    )


def test_a_range_reads_lines_across_blocks_and_a_last_line_without_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 7 bytes cut every line several times; the last line has no newline
    and a blank line stands between threads: the same findings and counts."""
    chains = [honest_chain(thread_id) for thread_id in THREADS[:4]]
    folder = write(tmp_path / "bundle", chains, {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    lines.insert(8, b"\n")
    lines[-1] = lines[-1].rstrip(b"\n")
    rewrite(folder, lines)
    monkeypatch.setattr(parallel, "BLOCK", 7)

    one, many = both(folder, 3)

    assert ordered(many) == ordered(one)
    assert [f.found for f in many] == ["line 9: not JSON"]


def test_a_summary_counts_every_range(tmp_path: Path) -> None:
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {})
    summary = verify_bundle_parallel(folder, TRUST, [].append, jobs=3)
    assert summary == Summary(threads=12, records=48, failures=0)
    assert (folder / CHECKPOINTS).read_bytes() == b""


def test_one_thread_asked_for_is_one_range_whatever_lies_between_its_lines(
    tmp_path: Path,
) -> None:
    """--thread verifies one chain: one process reads its rows as one group, however
    other threads' lines interleave, so a cut between its rows would split it (a
    review found --jobs 5 failing what one process passes)."""
    first, second = honest_chain("t-00"), honest_chain("t-01")
    folder = write(tmp_path / "bundle", [first, second], {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rewrite(folder, [*lines[0:3], *lines[4:8], lines[3]])  # t-00's version 3 after t-01
    assert cuts(folder, 5)  # without --thread the file is cut between t-00 and t-01

    one: list[Finding] = []
    alone = verify_bundle(folder, TRUST, one.append, thread_id="t-00")
    many: list[Finding] = []
    together = verify_bundle_parallel(folder, TRUST, many.append, jobs=5, thread_id="t-00")

    assert (alone.failures, many) == (0, one)
    assert together == alone


def test_a_cut_that_is_no_line_start_in_the_bytes_read_gives_no_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file changes between the cut and the read: the newline before the cut
    becomes a space, so the two rows around it are one line that is no JSON. Both
    ranges would verify (and hash the same bytes as the leader): the leader must see
    that its read no longer has a line start there (a review's finding)."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {})
    found = parallel._cuts

    def cut_then_join(handle: BinaryIO, size: int, jobs: int) -> list[tuple[int, str]]:
        made = found(handle, size, jobs)
        with (folder / RECORDS).open("r+b") as records:
            records.seek(made[0][0] - 1)
            records.write(b" ")
        return made

    monkeypatch.setattr(parallel, "_cuts", cut_then_join)
    findings: list[Finding] = []

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, TRUST, findings.append, jobs=2)

    assert str(stopped.value).startswith(f"{folder / RECORDS} changed while it was verified")
    assert findings == []


def test_workers_read_the_file_the_leader_opened_not_what_the_path_names_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """records.jsonl is replaced by a link to /dev/zero once the leader has opened it:
    workers that opened the path again read an endless line (a review's finding)."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {"t-03": {2: chains[3].rows[2].digest}})
    found = parallel._cuts

    def cut_then_swap(handle: BinaryIO, size: int, jobs: int) -> list[tuple[int, str]]:
        (folder / RECORDS).rename(tmp_path / "moved.jsonl")
        (folder / RECORDS).symlink_to("/dev/zero")
        (folder / CHECKPOINTS).rename(tmp_path / "moved-checkpoints.jsonl")
        (folder / CHECKPOINTS).symlink_to("/dev/zero")
        return found(handle, size, jobs)

    monkeypatch.setattr(parallel, "_cuts", cut_then_swap)
    findings: list[Finding] = []

    summary = verify_bundle_parallel(folder, TRUST, findings.append, jobs=3)

    assert (summary, findings) == (Summary(threads=12, records=48, failures=0), [])


def test_threads_of_equal_size_are_cut_at_every_share_boundary(tmp_path: Path) -> None:
    """With one thread a share, every boundary falls exactly where a share begins: the
    scan for a cut must see it (a review found no cut at all, one worker for all)."""
    chains = [honest_chain(f"t-{number}") for number in range(4)]  # ids of one length
    folder = write(tmp_path / "bundle", chains, {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    sizes = {sum(map(len, lines[n : n + 4])) for n in range(0, 16, 4)}
    assert len(sizes) == 1  # four threads of equal size: the shares' starts are theirs

    assert [owner for _, owner in cuts(folder, 4)] == ["t-1", "t-2", "t-3"]


def test_a_file_that_grows_after_its_cut_is_not_read_past_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """records.jsonl grows by 64 MiB of holes once cut: the workers read up to the size
    the leader took, and so does the leader, which then finds the size changed (a
    review found it hashing whatever a writer kept adding)."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {})
    size = (folder / RECORDS).stat().st_size
    found = parallel._cuts

    def cut_then_grow(handle: BinaryIO, at: int, jobs: int) -> list[tuple[int, str]]:
        made = found(handle, at, jobs)
        os.truncate(folder / RECORDS, size + 64 * 1024 * 1024)
        return made

    monkeypatch.setattr(parallel, "_cuts", cut_then_grow)
    read: list[int] = []
    block = parallel.Tally.block
    monkeypatch.setattr(
        parallel.Tally, "block", lambda t, data: read.append(len(data)) or block(t, data)
    )

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, TRUST, [].append, jobs=2)

    assert str(stopped.value) == (
        f"{folder / RECORDS} changed while it was verified (more than the {size} bytes it "
        "had when cut): the ledger is NOT verified; verify a copy nothing writes to"
    )
    assert sum(read) == size  # and one byte more, which says the file grew


def test_a_checkpoints_pipe_sends_the_bundle_to_one_process_before_any_finding(
    tmp_path: Path,
) -> None:
    """The fall-back to one process comes before the manifest's findings are reported:
    a review found them reported twice (by the parallel run, then by one process)."""
    chains = [honest_chain(thread_id) for thread_id in THREADS[:3]]
    folder = write(tmp_path / "bundle", chains, {})
    (folder / "policies.jsonl").write_bytes(b"not a policy\n")  # a finding of the manifest's
    data = (folder / CHECKPOINTS).read_bytes()
    (folder / CHECKPOINTS).unlink()
    os.mkfifo(folder / CHECKPOINTS)

    def feed() -> None:
        with (folder / CHECKPOINTS).open("wb") as fifo:
            fifo.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    findings: list[Finding] = []
    try:
        verify_bundle_parallel(folder, TRUST, findings.append, jobs=2)
    finally:
        writer.join()

    assert [f.check for f in findings].count("bundle.line") == 1


def test_a_row_at_a_cut_that_changed_before_the_read_gives_no_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the cut and the read, the row the cut begins at becomes a line of the
    same length that is no row: the leader and the worker read and hash the same
    bytes, and a line still starts at the cut, but the cut no longer parts two
    threads where one process would see a new one."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {})
    found = parallel._cuts

    def cut_then_blank(handle: BinaryIO, size: int, jobs: int) -> list[tuple[int, str]]:
        made = found(handle, size, jobs)
        data = (folder / RECORDS).read_bytes()
        at = made[0][0]
        with (folder / RECORDS).open("r+b") as records:
            records.seek(at)
            records.write(b"x" * (data.index(b"\n", at) - at))
        return made

    monkeypatch.setattr(parallel, "_cuts", cut_then_blank)
    findings: list[Finding] = []

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, TRUST, findings.append, jobs=2)

    assert str(stopped.value) == (
        f"{folder / RECORDS} changed while it was verified (the cut before worker 2 of 2 "
        "is no longer between two threads): the ledger is NOT verified; verify a copy "
        "nothing writes to"
    )


def test_checkpoints_that_change_while_workers_read_them_give_no_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker read checkpoints.jsonl before the change, the leader after it: the run
    names the checkpoints file, and gives no verdict."""
    chains = [honest_chain(thread_id) for thread_id in THREADS]
    folder = write(tmp_path / "bundle", chains, {"t-00": {1: chains[0].rows[1].digest}})
    changed, tell = os.pipe()
    check = parallel._check_checkpoints

    def after_the_change(*args: Any) -> Any:
        os.read(changed, 1)  # blocks until a worker changed the file
        return check(*args)

    monkeypatch.setattr(parallel, "_check_checkpoints", after_the_change)
    # once the worker has read checkpoints.jsonl (smaller than a block): then the
    # leader is told (a byte on tell)
    keys = RewrittenInAWorker(folder / CHECKPOINTS, after=lambda: os.write(tell, b"x"))
    trust = Trust(KEYRING, keys, POLICIES, {"cp-k1": CHECKPOINT_KEY.public_key()})
    try:
        with pytest.raises(VerifyError) as stopped:
            verify_bundle_parallel(folder, trust, [].append, jobs=2)
    finally:
        os.close(changed)
        os.close(tell)

    # the worker that read the file before the change: the first, unless the second
    # changed it before the first had read it
    assert re.fullmatch(
        re.escape(f"{folder / CHECKPOINTS} changed while it was verified (worker ")
        + "[12]"
        + re.escape(
            " of 2 read other bytes than the leader): the ledger is NOT verified; "
            "verify a copy nothing writes to"
        ),
        str(stopped.value),
    )


def test_workers_that_cannot_start_stop_the_run_as_unable_to_verify(tmp_path: Path) -> None:
    """Out of descriptors for 16 workers (a real limit, set in a process of its own):
    exit 2's VerifyError, not a bare OSError (whose exit code 1 means findings)."""
    chains = [honest_chain(thread_id) for thread_id in THREADS[:2]]
    folder = write(tmp_path / "bundle", chains, {})
    script = (
        "import resource, sys\n"
        "from tests.unit.test_verify_bundle_ranges import TRUST\n"
        "from ztate.services.verify.checks import VerifyError\n"
        "from ztate.services.verify.parallel import verify_bundle_parallel\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
        "try:\n"
        f"    verify_bundle_parallel(__import__('pathlib').Path({str(folder)!r}), TRUST,"
        " [].append, jobs=16)\n"
        "except VerifyError as error:\n"
        "    print(error)\n"
        "    sys.exit(2)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (
        2,
        "cannot start 16 verification workers (Too many open files); run with fewer --jobs\n",
    ), done.stderr


def test_the_cut_search_holds_no_more_of_a_long_line_than_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's search for where a worker's range begins reads the lines around an
    equal share of the file: a line over bundle.MAX_LINE (here 4 KiB, read in blocks of
    4 KiB) is read past in blocks, not held (it is no row, so no cut is made there).
    Before, it was read whole: one endless line took all the memory."""
    monkeypatch.setattr(bundle, "MAX_LINE", 4096)
    monkeypatch.setattr(parallel, "BLOCK", 4096)
    path = tmp_path / RECORDS
    path.write_bytes(b"a\n" + b"x" * 1_000_000 + b"\n" + b"b\n")
    with path.open("rb") as handle:
        tracemalloc.start()
        try:
            cuts = parallel._cuts(handle, path.stat().st_size, 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert cuts == []
    assert peak < 64 * 1024
