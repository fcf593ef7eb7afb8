"""``ztate verify --jobs N`` when a worker process does not finish: it is killed, it
raises, its database connection drops, or the bundle file ends while workers run.

The run must never say "verified" of a ledger part of which nobody checked: it stops
with exit code 2 and one line naming the worker, how it ended and the threads it was
given, and it never hangs. The workers are real forked processes and die for real:
by SIGKILL or an exception at a known record (through the approval keys they inherit
from the leader), or because a test terminates one's Postgres backend while the
worker waits on a lock the test holds. Bundle runs are guarded by a watchdog that
fails the test (instead of hanging the suite) if the verifier hangs.
"""

from __future__ import annotations

import asyncio
import base64
import faulthandler
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.harness import fresh_database
from tests.integration.test_watch_limits import eventually
from tests.unit.test_verify_bundle import APPROVAL_KEY, KEYRING, POLICIES, THREAD, honest_chain
from tests.unit.test_verify_bundle import write as write_bundle
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.record import GENESIS_PARENT, KIND_GENESIS, KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import apply_patch
from ztate.services.store.migrate import migrate
from ztate.services.verify.bundle import (
    BUNDLE_COUNT,
    BUNDLE_HASH,
    BUNDLE_LINE,
    CHECKPOINTS,
    RECORDS,
    BundleError,
    verify_bundle,
)
from ztate.services.verify.checks import HEAD, Finding, Trust, VerifyError
from ztate.services.verify.parallel import verify_bundle_parallel

REPO = Path(__file__).resolve().parents[2]
ZTATE = Path(sys.executable).with_name("ztate")
POLICY_FILE = REPO / "services" / "defaults" / "policy.yaml"
WATCHDOG_SECONDS = 60


@pytest.fixture
def watchdog() -> Iterator[None]:
    """A hang fails the run with every thread's traceback, instead of hanging it."""
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class DeadlyKeys(Mapping[str, Ed25519PublicKey]):
    """The approval keys, except that looking one up in a worker process (which the
    worker does at the first record with a receipt) kills it or raises."""

    def __init__(self, how: str) -> None:
        self._keys = {"approval-k1": APPROVAL_KEY.public_key()}
        self._how, self._leader = how, os.getpid()

    def __getitem__(self, key_id: str) -> Ed25519PublicKey:
        if os.getpid() != self._leader:
            if self._how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if self._how == "stuck":  # alive, its pipe open, and never a record more
                threading.Event().wait()
            raise RuntimeError("a bug in the checks, with a value: secret-ish")
        return self._keys[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@pytest.mark.parametrize(
    ("how", "ended"),
    [("killed", "was killed by signal 9 (SIGKILL)"), ("raises", "failed (RuntimeError raised)")],
)
def test_a_worker_that_dies_mid_thread_stops_the_run_naming_its_threads(
    tmp_path: Path, watchdog: None, how: str, ended: str
) -> None:
    # version 2 carries a receipt: the worker verifies versions 0 and 1, then dies
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    trust = Trust(KEYRING, DeadlyKeys(how), POLICIES)
    findings: list[Finding] = []

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, trust, findings.append, jobs=2)

    assert str(stopped.value) == (
        f"verification worker 1 of 2 {ended} before it finished; the ledger is NOT "
        "verified. Not (all) checked: every thread."  # one thread: one range, no cut
    )
    assert "secret-ish" not in str(stopped.value)  # an exception's text may hold a value
    assert findings == []


def test_a_worker_stuck_mid_thread_stops_the_run_naming_it_and_what_it_verified(
    tmp_path: Path, watchdog: None
) -> None:
    """Alive, its pipe open, but never a record more after version 1: without a
    progress deadline the leader waited for its count for ever."""
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    trust = Trust(KEYRING, DeadlyKeys("stuck"), POLICIES)
    findings: list[Finding] = []

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, trust, findings.append, jobs=2, worker_timeout=1.0)

    assert str(stopped.value) == (
        "verification worker 1 of 2 made no progress for 1 s (--worker-timeout) and was "
        "stopped (records read: 3, threads: 1); the ledger is NOT verified. "
        "Not (all) checked: every thread."
    )
    assert findings == []


def test_a_bundle_pipe_that_ends_early_is_never_verified_with_jobs(
    tmp_path: Path, watchdog: None
) -> None:
    """records.jsonl is a pipe the test writes: it ends in the middle of line 3. A pipe
    cannot be cut into ranges, so --jobs reads it in one process, which waits for more
    and never hangs. The manifest describes the whole file."""
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    whole = (folder / RECORDS).read_bytes()
    lines = whole.splitlines(keepends=True)
    cut = len(lines[0]) + len(lines[1]) + len(lines[2]) // 2
    (folder / RECORDS).unlink()
    os.mkfifo(folder / RECORDS)

    def write_part() -> None:
        with (folder / RECORDS).open("wb") as fifo:  # blocks until the verifier opens it
            fifo.write(whole[:cut])

    writer = threading.Thread(target=write_part)
    writer.start()
    findings: list[Finding] = []
    try:
        summary = verify_bundle_parallel(folder, trust_of_bundle(), findings.append, jobs=2)
    finally:
        writer.join()

    assert summary.exit_code == 1
    assert summary.records == 2  # versions 0 and 1; line 3 is no row
    assert sorted((f.check, f.thread_id or "", f.version or 0) for f in findings) == [
        (BUNDLE_COUNT, "", 0),
        (BUNDLE_HASH, "", 0),
        (BUNDLE_LINE, "", 0),  # line 3: the part of it that arrived is no row
        (HEAD, THREAD, 3),  # the manifest's head is version 3, the last record read is 1
    ]


@pytest.mark.parametrize("jobs", [1, 2], ids=["one-process", "two-workers"])
@pytest.mark.parametrize("name", [RECORDS, CHECKPOINTS])
def test_a_bundle_file_whose_read_fails_stops_the_run_naming_it(
    tmp_path: Path, watchdog: None, jobs: int, name: str
) -> None:
    """A read that fails (a disk error, a network share gone) is no end of file: the
    run stops (exit 2), never verifying what it could not read. The file is a link to
    /proc/self/mem, whose read at offset 0 fails with EIO in whichever process reads it."""
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    (folder / name).unlink()
    (folder / name).symlink_to("/proc/self/mem")
    # checkpoints are read whenever their public keys are at hand (none needed here)
    trust = Trust(KEYRING, {"approval-k1": APPROVAL_KEY.public_key()}, POLICIES, {})
    findings: list[Finding] = []

    def run() -> None:
        if jobs == 1:
            verify_bundle(folder, trust, findings.append)
        else:
            verify_bundle_parallel(folder, trust, findings.append, jobs=jobs)

    with pytest.raises(BundleError) as stopped:
        run()

    assert str(stopped.value) == (
        f"{folder / name}: reading failed after line 0 (Input/output error): "
        "the rest of the bundle is not verified"
    )
    assert findings == []


def trust_of_bundle() -> Trust:
    return Trust(KEYRING, {"approval-k1": APPROVAL_KEY.public_key()}, POLICIES)


# --- a database worker whose connection drops --------------------------------------------

NODE = "spiffe://ztate.test/node/planner"
OPERATOR = "spiffe://ztate.test/operator/admin"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
# the ledger columns sealed_thread's rows hold, in its order (COPY)
TRANSITION_COLUMNS = (
    "thread_id",
    "version",
    "digest",
    "parent_digest",
    "node_id",
    "key_id",
    "signature",
    "record",
    "state",
    "committed_at",
)
THREAD_COLUMNS = ("thread_id", "version", "head_digest", "state", "policy_name", "policy_digest")


def sealed_thread(thread_id: str, versions: int) -> list[tuple[Any, ...]]:
    """A clean thread's transition rows (COPY tuples), sealed under the test keyring."""
    policy = POLICIES.policies["pipeline"]
    rows: list[tuple[Any, ...]] = []
    state: dict[str, Any] = {}
    parent = GENESIS_PARENT
    for version in range(versions):
        patch: dict[str, Any] = (
            {"raw_text": "refund", "authority": {"tenant": "acme"}}
            if version == 0
            else {"pending_transition": {"action": "refund", "order_id": f"A-{version}"}}
        )
        state = apply_patch(state, patch)
        state_bytes = canonical_bytes(state)
        committed_at = T0 + timedelta(minutes=version)
        sealed = seal(
            build_record(
                kind=KIND_GENESIS if version == 0 else KIND_TRANSITION,
                thread_id=thread_id,
                version=version,
                parent_digest=parent,
                node_id=OPERATOR if version == 0 else NODE,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id="k1",
                committed_at=committed_at,
            ),
            KEYRING,
        )
        rows.append(
            (
                thread_id,
                version,
                sealed.digest,
                parent,
                sealed.record["node_id"],
                "k1",
                sealed.signature,
                sealed.record_bytes,
                state_bytes,
                committed_at,
            )
        )
        parent = sealed.digest
    return rows


async def a_ledger(
    server_dsn: str,
    threads: list[str],
    tamper: Callable[[str, list[tuple[Any, ...]]], None] | None = None,
) -> str:
    """A fresh database with ``threads`` of 3 clean versions each; ``tamper`` may
    change a thread's rows (in place) before they are stored."""
    dsn = await fresh_database(server_dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, "ztate_transition")
        policy = POLICIES.policies["pipeline"]
        for thread_id in threads:
            rows = sealed_thread(thread_id, 3)
            if tamper is not None:
                tamper(thread_id, rows)
            last = rows[-1]
            await conn.copy_records_to_table(
                "threads",
                schema_name="ztate",
                records=[(thread_id, last[1], last[2], last[8], policy.name, policy.digest)],
                columns=THREAD_COLUMNS,
            )
            await conn.copy_records_to_table(
                "transitions", schema_name="ztate", records=rows, columns=TRANSITION_COLUMNS
            )
    finally:
        await conn.close()
    return dsn


def cli_env(dsn: str, root: Path) -> dict[str, str]:
    """``ztate verify`` configured as an auditor's script would: key files and the policy."""
    keyring = root / "hmac-keyring.json"
    keyring.write_text(
        json.dumps({"current": "k1", "keys": {"k1": base64.b64encode(bytes(range(32))).decode()}})
    )
    approval = root / "approval-public.json"
    raw = APPROVAL_KEY.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    approval.write_text(json.dumps({"approval-k1": base64.b64encode(raw).decode()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=dsn,
        ZTATE_HOME=str(root / "home"),
        ZTATE_HMAC_KEYRING_FILE=str(keyring),
        ZTATE_APPROVAL_PUBLIC_KEYS_FILE=str(approval),
        ZTATE_POLICY_PATH=str(POLICY_FILE),
    )
    return env


class HeldRun:
    """``ztate verify --jobs N`` started while the test holds an exclusive lock on
    ``ztate.transitions``: each worker's first read waits behind it, inside its share,
    until ``release``. ``watcher`` is a connection of the test's own."""

    def __init__(self, dsn: str, locker: asyncpg.Connection, watcher: asyncpg.Connection) -> None:
        self.dsn, self.locker, self.watcher = dsn, locker, watcher
        self._lock = locker.transaction()
        self.process: asyncio.subprocess.Process | None = None

    @classmethod
    async def start(
        cls, dsn: str, env: dict[str, str], jobs: int, worker_timeout: int | None = None
    ) -> HeldRun:
        held = cls(dsn, await asyncpg.connect(dsn), await asyncpg.connect(dsn))
        await held._lock.start()
        await held.locker.execute("LOCK TABLE ztate.transitions IN ACCESS EXCLUSIVE MODE")
        held.process = await asyncio.create_subprocess_exec(
            str(ZTATE),
            *("verify", "--jobs", str(jobs), "--json"),
            *(() if worker_timeout is None else ("--worker-timeout", str(worker_timeout))),
            env=env,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return held

    async def sessions(self) -> list[asyncpg.Record]:
        """The run's sessions: every client backend of the database but the test's two."""
        return await self.watcher.fetch(
            "SELECT pid, state, wait_event_type, backend_xmin::text AS xmin "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> ALL($1::int[]) ORDER BY pid",
            [self.locker.get_server_pid(), self.watcher.get_server_pid()],
        )

    async def waiting(self, count: int) -> list[int]:
        """Once ``count`` of the run's sessions wait on the lock: their pids."""
        pids: list[int] = []

        async def they_wait() -> bool:
            pids[:] = [r["pid"] for r in await self.sessions() if r["wait_event_type"] == "Lock"]
            return len(pids) == count

        await eventually(they_wait)
        return pids

    async def release_and_finish(self) -> tuple[int, bytes, bytes]:
        await self._lock.rollback()
        assert self.process is not None
        out, err = await asyncio.wait_for(self.process.communicate(), 60)
        assert self.process.returncode is not None
        return self.process.returncode, out, err

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        await self.locker.close()
        await self.watcher.close()


async def test_a_worker_whose_connection_drops_stops_the_run_naming_its_range(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    dsn = await a_ledger(postgres_server_dsn, ["drop-a", "drop-b"])
    held = await HeldRun.start(dsn, cli_env(dsn, tmp_path), jobs=2)
    try:
        first, _ = await held.waiting(2)  # both workers inside their share
        assert await held.watcher.fetchval("SELECT pg_terminate_backend($1)", first)
        code, out, err = await held.release_and_finish()  # the other worker finishes
    finally:
        await held.close()

    assert code == 2
    assert out == b""  # no finding and, above all, no summary
    message = err.decode()
    shares = {"1": "the threads before drop-b", "2": "the threads from drop-b on"}
    match = re.fullmatch(
        r"ztate verify: cannot verify: verification worker (1|2) of 2 failed \(reading the "
        r"ledger failed: (\w+): (.*)\) before it finished; the ledger is NOT verified\. "
        r"Not \(all\) checked: (.*)\.\n",
        message,
    )
    assert match is not None, message
    assert match[4] == shares[match[1]]
    assert match[2] in {"AdminShutdownError", "ConnectionDoesNotExistError"}, message


async def test_a_database_run_holds_the_connections_docs_verification_md_names(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    """docs/verification.md: at most N + 1 connections at once, a worker with no range
    opens none, and every worker reads in the leader's exported snapshot."""
    dsn = await a_ledger(postgres_server_dsn, ["conn-a", "conn-b"])
    held = await HeldRun.start(dsn, cli_env(dsn, tmp_path), jobs=3)  # two ranges, 3 workers
    try:
        workers = await held.waiting(2)
        sessions = await held.sessions()
        code, out, err = await held.release_and_finish()
    finally:
        await held.close()

    # the leader (idle in its transaction) and the two workers with a range: the policy
    # read's connection is closed, the third worker has none
    assert len(sessions) == 3, sessions
    [leader] = [r for r in sessions if r["pid"] not in workers]
    assert leader["state"] == "idle in transaction"
    assert len({r["xmin"] for r in sessions}) == 1  # one snapshot: the exported one
    assert leader["xmin"] is not None
    assert code == 0, err.decode()
    assert json.loads(out.splitlines()[-1]) == {
        "type": "summary",
        "threads": 2,
        "records": 6,
        "failures": 0,
        "verified": True,
    }


async def test_a_worker_stuck_on_a_lock_stops_the_run_after_worker_timeout(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    """Both workers wait on the test's lock for ever (as on a dead server connection
    with no timeout): after --worker-timeout the run stops, exit 2, no verdict."""
    dsn = await a_ledger(postgres_server_dsn, ["stuck-a", "stuck-b"])
    held = await HeldRun.start(dsn, cli_env(dsn, tmp_path), jobs=2, worker_timeout=1)
    try:
        await held.waiting(2)  # both workers inside their share, blocked
        assert held.process is not None
        # the lock is never released: the run must end by itself
        out, err = await asyncio.wait_for(held.process.communicate(), 60)
        code = held.process.returncode
    finally:
        await held.close()

    assert code == 2
    assert out == b""  # no finding and, above all, no summary
    message = err.decode()
    shares = {"1": "the threads before stuck-b", "2": "the threads from stuck-b on"}
    match = re.fullmatch(
        r"ztate verify: cannot verify: verification worker (1|2) of 2 made no progress for "
        r"1 s \(--worker-timeout\) and was stopped \(records read: 0, threads: 0\); "
        r"the ledger is NOT verified\. Not \(all\) checked: (.*)\.\n",
        message,
    )
    assert match is not None, message
    assert match[2] == shares[match[1]]


@pytest.mark.parametrize("given", ["0", "0.5", "86401", "nan", "inf", "-1", "soon"])
def test_a_worker_timeout_out_of_range_is_a_usage_error(given: str, tmp_path: Path) -> None:
    import subprocess

    env = cli_env("postgresql://nobody@127.0.0.1:1/none", tmp_path)
    done = subprocess.run(
        [str(ZTATE), "verify", "--jobs", "2", "--worker-timeout", given],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 2
    assert done.stdout == b""
    expected = (
        f"--worker-timeout: {given!r} is not a number"
        if given == "soon"
        else "--worker-timeout: must be 1 to 86400"
    )
    assert expected in done.stderr.decode(), done.stderr.decode()


WORKER_TIMEOUT_ALONE = (
    "ztate: --worker-timeout bounds the worker processes of --jobs N: give --jobs (2 or "
    "more, or 0: one per core) or leave --worker-timeout out\n"
)


@pytest.mark.parametrize(
    "jobs", [pytest.param((), id="no --jobs"), pytest.param(("--jobs", "1"), id="--jobs 1")]
)
def test_a_worker_timeout_without_workers_is_a_usage_error(
    jobs: tuple[str, ...], tmp_path: Path
) -> None:
    """``--worker-timeout`` bounds the silence of ``--jobs`` worker processes: with one
    process there is none, and the flag is refused (exit 2, one line) before anything
    is read, rather than accepted and ignored."""
    import subprocess

    env = cli_env("postgresql://nobody@127.0.0.1:1/none", tmp_path)
    env["ZTATE_HMAC_KEYRING_FILE"] = str(tmp_path / "absent.json")  # never read
    done = subprocess.run(
        [str(ZTATE), "verify", *jobs, "--worker-timeout", "60"],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr.decode()) == (2, b"", WORKER_TIMEOUT_ALONE)


def test_a_worker_timeout_with_jobs_0_is_taken(tmp_path: Path) -> None:
    """``--jobs 0`` (one per core) asks for workers wherever it runs: the timeout is
    taken, and the run goes on to read its files (here, a keyring that is not there)."""
    import subprocess

    env = cli_env("postgresql://nobody@127.0.0.1:1/none", tmp_path)
    absent = tmp_path / "absent.json"
    env["ZTATE_HMAC_KEYRING_FILE"] = str(absent)
    done = subprocess.run(
        [str(ZTATE), "verify", "--jobs", "0", "--worker-timeout", "60"],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr.decode()) == (
        2,
        b"",
        f"ztate verify: cannot verify: {absent}: cannot read the keyring "
        "(No such file or directory)\n",
    )


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in {"Z", "X"}


async def test_workers_end_when_the_leader_is_killed(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    """The leader SIGKILLed while its two workers wait on the test's lock: they end
    at once instead of reading their whole range for nobody (here: waiting for a lock
    that is never released)."""
    dsn = await a_ledger(postgres_server_dsn, ["orphan-a", "orphan-b"])
    held = await HeldRun.start(dsn, cli_env(dsn, tmp_path), jobs=2)
    workers: list[int] = []
    try:
        await held.waiting(2)  # both workers inside their share, blocked
        assert held.process is not None
        workers = children_of(held.process.pid)
        assert len(workers) == 2, workers
        held.process.kill()

        async def workers_ended() -> bool:
            return all(ended(pid) for pid in workers)

        await eventually(workers_ended)
    finally:
        for pid in workers:  # the test's own children's children, should they live on
            if not ended(pid):
                os.kill(pid, signal.SIGKILL)
        await held.close()
