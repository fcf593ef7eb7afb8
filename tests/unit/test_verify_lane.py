"""The verifier's compiled lane (services/verify/_chain.c) against the reference.

The lane takes a line of records.jsonl only when it confirms, by itself, that the
reference (services/verify/checks.py) would find nothing in it, and carries the chain on
as the reference would. So whatever a bundle holds, a run with the lane must report
exactly what a run without it reports: the same findings in the same order, the same
summary. These tests hold it to that over honest bundles (where it must take nearly
every line: else it makes nothing faster) and over thousands of hostile edits, and hold
its canonical-JSON scanner to RFC 8785 (it may refuse canonical bytes, never accept
others).
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_verify_bundle import KEYRING, OPERATOR, POLICIES, RISKY, Chain, initial
from tests.unit.test_verify_bundle_ranges import TRUST, rewrite, write
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import KIND_REVERT, sign_digest
from ztate.services.verify import checks
from ztate.services.verify.bundle import CHECKPOINTS, MANIFEST, RECORDS, _line, verify_bundle
from ztate.services.verify.checks import SIGNATURE, Finding, Summary, Trust, Verification
from ztate.services.verify.parallel import verify_bundle_parallel

pytestmark = pytest.mark.unit

if checks.LANE is None:  # pragma: no cover - the build always has a compiler here
    pytest.fail("the compiled lane was not built (services/verify/_chain.c: gcc, libssl-dev)")
LANE = checks.LANE
KEY = KEYRING.key("k1")


class Counting:
    """The run's lane, counting the lines it took."""

    def __init__(self, lane: Any) -> None:
        self._lane = lane
        self.taken = 0
        self.declined = 0

    def start(self, *args: Any) -> bool:
        return bool(self._lane.start(*args))

    def add(self, line: bytes) -> bool:
        took = bool(self._lane.add(line))
        self.taken += took
        self.declined += not took
        return took

    def add_rows(self, rows: list[Any], start: int) -> tuple[int, int, int]:
        at, taken, head = self._lane.add_rows(rows, start)
        self.taken += taken
        self.declined += at < len(rows)  # it stopped before a row: it declined it
        return at, taken, head

    def feed(self, block: bytes, pos: int) -> tuple[int, int, int]:
        pos, taken, last = self._lane.feed(block, pos)
        self.taken += taken
        # the lane stopped before a whole line: it declined it
        self.declined += block.find(b"\n", pos) >= 0
        return pos, taken, last

    def take(self) -> Any:
        return self._lane.take()


def run(
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    lane: bool,
    trust: Trust = TRUST,
    jobs: int = 1,
) -> tuple[list[dict[str, Any]], Summary, list[Counting]]:
    """The findings (as JSON, in order) and the summary of a run with or without the lane."""
    counters: list[Counting] = []

    def counted(trust: Trust) -> Any:
        if not lane:
            return None
        counter = Counting(LANE_OF(trust))
        counters.append(counter)
        return counter

    monkeypatch.setattr(checks, "compiled_lane", counted)
    findings: list[Finding] = []
    if jobs == 1:
        summary = verify_bundle(folder, trust, findings.append)
    else:
        summary = verify_bundle_parallel(folder, trust, findings.append, jobs=jobs)
    return [f.as_json() for f in findings], summary, counters


LANE_OF = checks.compiled_lane


def rich_chains(carried: bool) -> list[Chain]:
    """Threads whose patches add, replace and remove members (nulls), in and out of
    order, with values of every JSON type, escapes and characters of every plane (the
    member names inside the BMP, so the lane orders them), and one risky transition
    under a receipt."""
    chains = []
    for number in range(6):
        chain = Chain(initial(), f"lane-{number:02d}", carried=carried)
        for version in range(1, 30):
            patch: dict[str, Any] = {
                "pending_transition": {"action": "refund", "order_id": f"A-{version}"},
                f"note_{version % 7}": [version, -version, True, None, {"z": "a\tb\u0001"}],
                "é_ünïcode": 'snowman ☃, clef 𝄞, quote " and backslash \\',
                "zz_last": version,
                "aa_first": None if version % 3 == 0 else {"n": version},
            }
            if version % 5 == 0:
                patch["pending_transition"] = None
            if version == 17 and number % 2 == 0:
                chain.propose(RISKY, approved=True)  # a receipt: the reference's line
                continue
            chain.propose(patch)
        chains.append(chain)
    return chains


@pytest.mark.parametrize("carried", [False, True], ids=["format-1", "format-2"])
def test_the_lane_takes_every_plain_transition_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, carried: bool
) -> None:
    chains = rich_chains(carried)
    folder = write(tmp_path / "bundle", chains, {"lane-01": {12: chains[1].rows[12].digest}})
    with_lane, summary, counters = run(folder, monkeypatch, lane=True)
    without, reference, _ = run(folder, monkeypatch, lane=False)
    assert with_lane == without == []
    assert summary == reference
    assert summary.records == 6 * 30
    # every line but the three under a receipt and the one at the checkpoint
    (counter,) = counters
    assert counter.taken == 6 * 30 - 3 - 1
    # each line declined once (those four, and the first line of each thread after the
    # first, met while the lane held the thread before): none offered twice
    assert counter.declined == 3 + 1 + 5


def test_the_lane_changes_nothing_on_worker_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write(tmp_path / "bundle", rich_chains(True), {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    row = json.loads(lines[40])
    row["state"] = row["state"].replace("refund", "refunt")  # a kept body that is not the state
    lines[40] = json.dumps(row, separators=(",", ":")).encode() + b"\n"
    rewrite(folder, lines)
    with_lane, summary, _ = run(folder, monkeypatch, lane=True, jobs=2)
    without, reference, _ = run(folder, monkeypatch, lane=False, jobs=2)
    assert with_lane == without != []
    assert summary == reference


def test_a_run_without_a_keyring_takes_the_lane_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Public-only verification checks no HMAC: neither does the lane."""
    folder = write(tmp_path / "bundle", rich_chains(True), {})
    trust = Trust(None, TRUST.approval_keys, POLICIES, TRUST.checkpoint_keys)
    with_lane, summary, counters = run(folder, monkeypatch, lane=True, trust=trust)
    without, reference, _ = run(folder, monkeypatch, lane=False, trust=trust)
    assert with_lane == without
    assert summary == reference
    assert counters[0].taken > 100


# --- hostile edits ------------------------------------------------------------------

# What an attacker (or a disk) may do to a line: each keeps the line's JSON readable
# often enough that the checks behind the parse are reached.
HEX = "0123456789abcdef"


def mutations(line: bytes, rng: random.Random) -> Iterator[bytes]:
    """Edits of one line of records.jsonl."""
    text = line.decode("utf-8", "surrogatepass")
    at = rng.randrange(len(line))
    yield line[:at] + bytes([rng.randrange(256)]) + line[at + 1 :]  # any byte
    yield line[:at] + line[at + 1 :]  # a byte dropped
    # one character of the line's text changed for another, JSON text still
    at = rng.randrange(len(text))
    for other in ("0", "a", "f", "1", " ", "\\\\", '\\"', "\\u0041", "é", "𝄞", ","):
        yield (text[:at] + other + text[at + 1 :]).encode("utf-8", "surrogatepass")
    row = json.loads(line)
    record = row["record"]
    for old, new in (
        ('"version":', '"version": '),
        ('"format":1', '"format":2'),
        ('"format":2', '"format":1'),
        ('"receipt_digest":null', '"receipt_digest":"' + "0" * 64 + '"'),
        ('"kind":"transition"', '"kind":"revert"'),
        ('"kind":"transition"', '"kind":"genesis"'),
        ("transition", "Transition"),
        ("planner", "reviewer"),
        ("node/", "operator/"),
        ('"zz_last":', '"zz_last":1.0,"zz_lasu":'),
        ('"aa_first":null', '"aa_first":{}'),
        ("}", ',"risk_rules":[]}'),
        ('"risk_rules":[]', '"risk_rules":["target-user-change"]'),
        ("\\u0001", "\\u0001\\u001F"),
        ("\\t", "\\u0009"),
        ("☃", "\\u2603"),
        ('"é_ünïcode"', '"\\u00e9_ünïcode"'),
        ("A-", "A\\/"),
        ("2026-", "2027-"),
        ("T00:", "T24:"),
    ):
        if old in record:
            yield (
                json.dumps(
                    {**row, "record": record.replace(old, new, 1)}, separators=(",", ":")
                ).encode()
                + b"\n"
            )
    for name in ("digest", "parent_digest", "signature"):
        value = row[name]
        spot = rng.randrange(len(value))
        changed = value[:spot] + rng.choice(HEX.replace(value[spot], "")) + value[spot + 1 :]
        yield json.dumps({**row, name: changed}, separators=(",", ":")).encode() + b"\n"
    for name, value in (
        ("state", None),
        ("state", (row["state"] or "")[:-1]),
        ("committed_at", None),
        ("committed_at", "2026-01-01T00:00:00.000000Z"),
        ("receipt_signature", "x"),
        ("receipt_key_id", "approval-k1"),
        ("node_id", "spiffe://ztate.test/node/planner\u0000"),
        ("key_id", "k2"),
        ("version", row["version"] + 1),
        ("thread_id", row["thread_id"] + "x"),
        ("record", {"base64": "e30="}),
    ):
        yield json.dumps({**row, name: value}, separators=(",", ":")).encode() + b"\n"
    # the line written with escapes where the exporter writes none: the same row
    yield json.dumps(row, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
    yield json.dumps(row).encode() + b"\n"  # with spaces


def test_every_hostile_edit_is_found_alike_with_and_without_the_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chains = rich_chains(True)[:1]
    folder = write(tmp_path / "bundle", chains, {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rng = random.Random(19)
    cases = taken = 0
    for index in range(len(lines)):
        for edited in mutations(lines[index], rng):
            changed = [*lines]
            changed[index] = edited if edited.endswith(b"\n") else edited + b"\n"
            rewrite(folder, changed)  # the manifest made to match: the rows are checked
            with_lane, summary, counters = run(folder, monkeypatch, lane=True)
            without, reference, _ = run(folder, monkeypatch, lane=False)
            assert with_lane == without, (index, edited)
            assert summary == reference, (index, edited)
            cases += 1
            taken += counters[0].taken
    assert cases > 1300
    assert taken > cases * 20  # the lane ran: it took the lines around each edit


def test_lines_moved_and_repeated_are_found_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write(tmp_path / "bundle", rich_chains(False)[:2], {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rng = random.Random(8785)
    for _ in range(150):
        changed = [*lines]
        a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
        choice = rng.randrange(3)
        if choice == 0:
            changed[a], changed[b] = changed[b], changed[a]
        elif choice == 1:
            changed.insert(a, lines[b])
        else:
            del changed[a]
        rewrite(folder, changed)
        with_lane, summary, _ = run(folder, monkeypatch, lane=True)
        without, reference, _ = run(folder, monkeypatch, lane=False)
        assert with_lane == without
        assert summary == reference


@pytest.mark.parametrize("jobs", [1, 2], ids=["one-process", "two-workers"])
def test_versions_beyond_the_lane_are_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    """A version of 20 digits (a bundle line's, spelled 1e19 in its record, which the
    reference re-synchronises on) and a checkpoint at version 2^64: the lane takes no
    version above 15 digits, and must not stop the run over one (a review found it
    raised OverflowError out of ztate verify)."""
    chain = Chain(initial(), "t-huge")
    row = chain.propose({"pending_transition": {"action": "refund", "order_id": "A-1"}})
    record = row.record.replace(b'"version":1', b'"version":1e19')
    digest = sha256_hex(record)
    chain.rows[1] = dataclasses.replace(
        row, version=10**19, record=record, digest=digest, signature=sign_digest(KEY, digest)
    )
    for version in range(2, 6):
        chain.propose({"pending_transition": {"action": "refund", "order_id": f"A-{version}"}})
    folder = write(tmp_path / "bundle", [chain], {"t-huge": {3: chain.rows[3].digest}})
    path = folder / CHECKPOINTS
    huge = path.read_bytes().replace(b'"version":3', b'"version":' + str(2**64).encode())
    path.write_bytes(huge)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(checkpoints_sha256=sha256_hex(huge))
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with_lane, summary, _ = run(folder, monkeypatch, lane=True, jobs=jobs)
    without, reference, _ = run(folder, monkeypatch, lane=False, jobs=jobs)
    assert with_lane == without
    assert summary == reference
    checks_found = {(f["version"], f["check"]) for f in with_lane}
    assert {(10**19, "canonical"), (2**64, "checkpoint")} <= checks_found, checks_found


def test_a_run_freezes_what_the_process_held_and_leaves_the_collector_as_it_was(
    tmp_path: Path,
) -> None:
    folder = write(tmp_path / "bundle", rich_chains(True)[:1], {})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rewrite(folder, [*lines[:5], *lines[6:]])  # a gap: a finding, reported mid-run
    during: list[int] = []

    def report(finding: Finding) -> None:
        during.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    verify_bundle(folder, TRUST, report)
    assert during
    assert all(count > 0 for count in during)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # an application's own freeze: the run leaves it alone
    try:
        frozen = gc.get_freeze_count()
        verify_bundle(folder, TRUST, report)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


# --- the canonical scanner ------------------------------------------------------------

names = st.text(st.characters(max_codepoint=0xFFFF, blacklist_categories=("Cs",)), max_size=6)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**15) + 1, 10**15 - 1)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4),
    max_leaves=12,
)
objects = st.dictionaries(names, json_values, max_size=5)


def plain_names(value: Any) -> bool:
    """Whether every member name is one the lane orders (nothing it escapes)."""
    if isinstance(value, dict):
        return all(
            not any(c in '"\\' or ord(c) < 0x20 for c in k) and plain_names(v)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return all(plain_names(v) for v in value)
    return True


@settings(max_examples=400, deadline=None)
@given(objects)
def test_the_scanner_takes_canonical_objects_with_plain_names(value: dict[str, Any]) -> None:
    assert LANE.canonical(canonical_bytes(value)) == plain_names(value)


# what an edit puts in: JSON's punctuation, escapes, numbers' characters, bytes of
# every UTF-8 form (a surrogate and an overlong among them)
PIECES = [b"", b" ", b"0", b"-", b".", b"e", b'"', b"\\", b",", b":", b"{", b"}", b"[", b"]"]
PIECES += [b"\\u00", b"\\/", b"\x7f", b"\xc3", b"\xa9", b"\xed\xa0\x80", b"\xc0\xaf"]
PIECES += [b"\xf0\x9d\x84\x9e", b"null", b"1", b"a", b'"a":1,', b"\\u001f", b"\\n"]


@settings(max_examples=800, deadline=None)
@given(objects, st.data())
def test_the_scanner_takes_nothing_that_is_not_canonical(value: Any, data: st.DataObject) -> None:
    """Whatever bytes it takes are canonical JSON of an object: an edit of canonical
    bytes is taken only when the edited bytes are their own RFC 8785 form too."""
    encoded = bytearray(canonical_bytes(value))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(encoded)))
        piece = data.draw(st.sampled_from(PIECES))
        cut = data.draw(st.integers(0, 2))
        encoded[at : at + cut] = piece
    candidate = bytes(encoded)
    if LANE.canonical(candidate):
        parsed = orjson.loads(candidate)
        assert isinstance(parsed, dict)
        assert canonical_bytes(parsed) == candidate


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":1.0}',
        b'{"a":1e2}',
        b'{"a":-0}',
        b'{"a":01}',
        b'{"a":1234567890123456}',
        b'{"b":1,"a":2}',
        b'{"a":1,"a":1}',
        b'{ "a":1}',
        b'{"a":1}\n',
        b'{"a":"\\/"}',
        b'{"a":"\\u001F"}',
        b'{"a":"\\u0008"}',
        b'{"a":"\\u0041"}',
        b'{"a":"\\ud834\\udd1e"}',
        b'{"\\u00e9":1}',
        b'{"\xf0\x9d\x84\x9e":1}',
        b'{"a":"\xed\xa0\x80"}',
        b'{"a":"\xc0\xaf"}',
        b'{"a":"\x01"}',
        b'{"a":tru}',
        b"[1]",
        b'{"a":' + b"[" * 70 + b"]" * 70 + b"}",
    ],
)
def test_the_scanner_refuses(data: bytes) -> None:
    assert LANE.canonical(data) is False


@pytest.mark.parametrize(
    "data",
    [
        b"{}",
        b'{"":0,"a":-1,"b":[true,false,null,{}],"\xc3\xa9":"\\u001f\\b\x7f\xf0\x9d\x84\x9e"}',
        b'{"a":123456789012345}',
        b'{"a":"\\"\\\\\\n\\r\\t\\f"}',
    ],
)
def test_the_scanner_takes(data: bytes) -> None:
    assert LANE.canonical(data) is True
    assert canonical_bytes(orjson.loads(data)) == data


# --- the lane's own contract ------------------------------------------------------------


def test_a_reference_only_run_has_no_lane() -> None:
    assert LANE_OF(TRUST) is not None
    assert LANE_OF(dataclasses.replace(TRUST, reference_only=True)) is None


def test_a_lane_built_wrong_refuses_to_run() -> None:
    """Misuse of the type, not ledger input: a TypeError, then no chain, never a crash."""
    with pytest.raises(TypeError, match="keys maps str to bytes"):
        LANE.Lane({"k1": "not bytes"}, {}, print, print)
    with pytest.raises(TypeError, match="policies maps str to"):
        LANE.Lane(None, {"d": ("name", True, (("state", ("not bytes",)),))}, print, print)
    half = LANE.Lane.__new__(LANE.Lane)
    with pytest.raises(RuntimeError, match="not initialised"):
        half.start(b"t", 0, "0" * 64, b"{}", None, -1)
    with pytest.raises(RuntimeError, match="no chain started"):
        half.add(b"{}")


def test_a_thread_without_an_id_stays_the_references() -> None:
    """A null thread_id (a database whose primary key was dropped): the lane takes no
    part of it (a review found lane_start raised AttributeError on it)."""
    run = Verification(TRUST, print)
    lane = run.lane
    assert lane is not None
    thread = run.thread(None)  # type: ignore[arg-type]
    assert thread.lane_start(lane) is False
    assert run.thread("t").lane_start(lane) is True


def test_a_lane_refuses_to_add_without_a_chain_and_a_state_it_cannot_order() -> None:
    lane = LANE_OF(TRUST)
    with pytest.raises(RuntimeError, match="no chain started"):
        lane.add(b"{}")
    with pytest.raises(RuntimeError, match="no chain started"):
        lane.take()
    # a member name with an escape: the lane cannot order it, the reference replays
    assert lane.start(b"t", 1, "0" * 64, b'{"a\\"b":1}', None, -1) is False
    with pytest.raises(RuntimeError, match="no chain started"):
        lane.add(b"{}")
    # a parent that is not 64 lower-case hex digits: the lane compares a row's
    # parent_digest with it and checks nothing more of it, so it starts from none
    for parent in ("A" * 64, "0" * 63, "0" * 63 + "g", "0" * 65):
        with pytest.raises(ValueError, match="a parent of 64 lower-case hex digits"):
            lane.start(b"t", 1, parent, b"{}", None, -1)
    assert lane.start(b"t", 1, "0" * 64, b"{}", None, -1) is True
    assert lane.add(b"not a line") is False
    assert lane.take() == (0, 1, "0" * 64, b"{}", None, "", None)


def test_a_signature_under_another_key_is_found_on_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane checks each HMAC under the run's key: a keyring whose k1 is another
    key finds every signature bad, with the lane as without it."""
    folder = write(tmp_path / "bundle", rich_chains(True)[:1], {})
    other = {"current": "k1", "keys": {"k1": base64.b64encode(b"\x11" * 32).decode()}}
    wrong = Trust(
        Keyring.from_json(json.dumps(other), source="test"),
        TRUST.approval_keys,
        POLICIES,
        TRUST.checkpoint_keys,
    )
    with_lane, summary, counters = run(folder, monkeypatch, lane=True, trust=wrong)
    without, reference, _ = run(folder, monkeypatch, lane=False, trust=wrong)
    assert with_lane == without
    assert summary == reference
    assert [f["check"] for f in with_lane] == [SIGNATURE] * 30
    assert counters[0].taken == 0


def test_feed_takes_a_line_only_when_its_newline_follows_it_in_the_block() -> None:
    """Lane.feed parses a line before it looks for its newline: the line must end,
    right after its closing brace, with a newline inside the block. A line cut at the
    block's end, ended by a carriage return first, or run into the next line is not
    taken (nothing changes); taken again whole, it is."""
    chain = rich_chains(True)[0]
    lines = [orjson.dumps(_line(row)) + b"\n" for row in chain.rows[:4]]
    thread = chain.thread_id.encode()

    def started() -> Any:
        lane = LANE_OF(TRUST)
        assert lane.start(thread, 0, "0" * 64, b"{}", None, -1) is True
        return lane

    lane = started()
    assert lane.feed(lines[0] + lines[1], 0) == (len(lines[0] + lines[1]), 2, len(lines[0]))
    for cut in (lines[2][:-1], lines[2][:-1] + b"\r\n", lines[2][:-1] + lines[3]):
        assert lane.feed(cut, 0) == (0, 0, -1)
    assert lane.feed(lines[2] + lines[3], 0) == (len(lines[2] + lines[3]), 2, len(lines[2]))
    records, expected, parent, *_ = lane.take()
    assert (records, expected, parent) == (4, 4, chain.rows[3].digest)
    # a line with its newline, fed at an offset: the same as add()
    lane = started()
    block = b"x" * 7 + lines[0]
    assert lane.feed(block, 7) == (len(block), 1, 7)


# Text whose escaped form in a line is dense with escapes: quotes and backslashes (the
# record embedded in a line escapes every quote of its own), control characters, and
# characters beyond ASCII, which stop the decoder's 16-byte packed runs.
escape_dense = st.text(
    alphabet=st.sampled_from(['"', "\\", "a", "/", "\n", "\u0001", "\u001f", "é", "☃", "𝄞"]),
    max_size=48,
)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), escape_dense), min_size=1, max_size=6))
def test_the_lane_takes_escapes_at_every_place_in_a_line(
    values: list[tuple[int, str]],
) -> None:
    """The line decoder packs runs of plain bytes and escaped quotes 16 at a time and
    leaves every other byte to its word loop: whatever place an escape, a control
    character or a multi-byte character falls at against those blocks (a padding of 0
    to 31 bytes moves it), the record and state decode to the bytes hashed, so an honest
    line is taken. (A decoded byte wrong would decline it: its digest or its state
    would not match.)"""
    chain = Chain(initial(), "escapes")
    for pad, text in values:
        chain.propose({"pad": "p" * pad, "text": text, "quoted": f'"{text}"\\'})
    lines = b"".join(orjson.dumps(_line(row)) + b"\n" for row in chain.rows)
    lane = LANE_OF(TRUST)
    assert lane.start(chain.thread_id.encode(), 0, "0" * 64, b"{}", None, -1) is True
    assert lane.feed(lines, 0)[:2] == (len(lines), len(chain.rows))
    records, expected, parent, *_ = lane.take()
    assert (records, expected, parent) == (len(chain.rows), len(chain.rows), chain.rows[-1].digest)


class _OneKey:
    """A keyring of one key of any length, as compiled_lane reads a keyring."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.key_ids = ("k1",)

    def key(self, key_id: str) -> bytes:
        assert key_id == "k1"
        return self._key


@pytest.mark.parametrize("length", [0, 1, 31, 32, 63, 64, 65, 200])
def test_the_lanes_hmac_is_rfc_2104_for_keys_of_every_length(length: int) -> None:
    """The lane builds HMAC-SHA256 on OpenSSL's SHA-256 (each key's padded states
    hashed once): a line signed by Python's hmac under a key shorter than, equal to or
    longer than SHA-256's 64-byte block (hashed first) is taken, and the same line
    under a key one bit away is not."""
    key = bytes((7 * i + length) % 256 for i in range(length))
    chain = rich_chains(True)[0]
    rows = [{**_line(row), "signature": sign_digest(key, row.digest)} for row in chain.rows[:8]]
    lines = b"".join(orjson.dumps(row) + b"\n" for row in rows)
    thread = chain.thread_id.encode()
    other = bytes([key[0] ^ 1]) + key[1:] if key else b"\x01"  # one bit away (or one byte)
    for signed_by, taken in ((key, 8), (other, 0)):
        lane = LANE_OF(dataclasses.replace(TRUST, keyring=_OneKey(signed_by)))
        assert lane.start(thread, 0, "0" * 64, b"{}", None, -1) is True
        assert lane.feed(lines, 0)[1] == taken


def test_a_revert_restores_a_state_the_lane_took_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane hands back the state digests it took as one string, which the
    reference reads only at a revert: a revert to a state of a version the lane took
    verifies, a revert to a state the thread never had is the one finding, with the
    lane and without it; and the state the lane handed back, parsed only then, is
    what the revert's patch replays on."""
    chain = Chain(initial(), "reverted")
    states = [dict(chain.state)]
    for version in range(1, 12):
        chain.propose({"step": version, f"key_{version % 3}": {"at": version}})
        states.append(dict(chain.state))

    def revert_to(target: dict[str, Any]) -> None:
        patch = {**{name: None for name in chain.state if name not in target}, **target}
        chain._append(KIND_REVERT, OPERATOR, patch, None)

    revert_to(states[4])
    for version in range(13, 16):
        chain.propose({"step": version})
    revert_to({**states[2], "never": True})
    folder = write(tmp_path / "bundle", [chain], {})
    with_lane, summary, counters = run(folder, monkeypatch, lane=True)
    without, reference, _ = run(folder, monkeypatch, lane=False)
    assert with_lane == without
    assert summary == reference
    assert [(f["version"], f["check"]) for f in with_lane] == [(16, "revert")]
    assert counters[0].taken == 1 + 11 + 3  # the genesis and every transition, no revert


def test_a_line_changed_byte_by_byte_is_taken_only_when_it_means_the_same() -> None:
    """The lane decodes a line's strings itself (16 bytes at a time where it can): of
    about 25,000 lines changed by one to three bytes (a quote, a backslash, a control
    character, a byte of a multi-byte character or none, a brace...) inserted,
    replaced or dropped anywhere, it takes only those that parse to the same JSON as
    the line they were made from (\\/ for /, say); every other one it declines. (Under
    ASan and UBSan, and for 500,000 changes, when the decoder was written.)"""
    rng = random.Random(2104)
    chain = Chain(initial(), "changed")
    for version in range(1, 13):
        chain.propose(
            {"pad": "p" * version, "text": '"\\' * version + 'é☃𝄞\n\t\u0001 "/" ' * (version % 4)}
        )
    lines = [orjson.dumps(_line(row)) + b"\n" for row in chain.rows]
    pieces = [b'"', b"\\", b"a", b"/", b"u", b"0", b"\x01", b"\x7f", b"\x80", b"\xc3", b"\xff"]
    thread = chain.thread_id.encode()
    lane = LANE_OF(TRUST)
    assert lane.start(thread, 0, "0" * 64, b"{}", None, -1) is True
    starts = []
    for line in lines:  # where the lane stands before each line
        starts.append(lane.take()[1:5])
        assert lane.start(thread, *starts[-1], -1) is True
        assert lane.add(line) is True
    same = changed = 0
    for version in range(1, len(lines)):
        original = json.loads(lines[version])
        for _ in range(2_000):
            line = bytearray(lines[version][:-1])
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(line))
                piece, how = rng.choice(pieces), rng.randrange(3)
                line[at : at + (how != 1)] = b"" if how == 2 else piece
            assert lane.start(thread, *starts[version], -1) is True
            if lane.add(bytes(line) + b"\n"):
                assert json.loads(line) == original, bytes(line)
                same += 1
            else:
                changed += 1
            lane.take()
    assert changed > 20_000
    assert same > 0  # some changes keep the meaning, and are taken
