"""The verifier's checks on synthetic chains, and bundles without a database.

The chains are built with the ledger's own sealing code and a test keyring, so
each test can produce exactly one defect a running service would never write:
a risky transition without a receipt, an expired or misbound receipt, a record
under an unknown policy or key. Tampering with stored rows of a real ledger is
tested in tests/integration/test_verify.py.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import threading
import tracemalloc
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.receipts import build_receipt, sign_receipt
from ztate.contract.record import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    build_proposal,
    build_record,
    format_time,
    seal,
    sign_digest,
)
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import PolicySet
from ztate.services.verify import bundle, parallel
from ztate.services.verify.bundle import (
    BUNDLE_COUNT,
    BUNDLE_HASH,
    BUNDLE_LINE,
    BUNDLE_MANIFEST,
    BUNDLE_ORDER,
    MANIFEST,
    MANIFEST_SIG,
    MAX_MANIFEST_SIG,
    RECORDS,
    TOO_LONG,
    BundleError,
    BundleWriter,
    LineReader,
    verify_bundle,
)
from ztate.services.verify.checks import Finding, LedgerRow, Summary, Trust, Verification
from ztate.services.verify.parallel import verify_bundle_parallel

REPO = Path(__file__).resolve().parents[2]
POLICIES = PolicySet.load(REPO / "services" / "defaults" / "policy.yaml")
POLICY = POLICIES.policies["pipeline"]
KEYRING = Keyring.from_json(
    json.dumps({"current": "k1", "keys": {"k1": base64.b64encode(bytes(range(32))).decode()}}),
    source="test",
)
APPROVAL_KEY = Ed25519PrivateKey.generate()
TRUST = Trust(KEYRING, {"approval-k1": APPROVAL_KEY.public_key()}, POLICIES)
THREAD = "unit-thread"
OPERATOR = "spiffe://ztate.test/operator/admin"
PLANNER = "spiffe://ztate.test/node/planner"
USER = "123e4567-e89b-42d3-a456-426614174000"
OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
T0 = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
RISKY = {"target_user_id": OTHER_USER}


class Chain:
    """Builds one thread's rows the way the transition service writes them."""

    def __init__(
        self, initial: JsonObject, thread_id: str = THREAD, *, carried: bool = False
    ) -> None:
        self.thread_id = thread_id
        self.rows: list[LedgerRow] = []
        self.state: JsonObject = {}
        # format 2 records, which carry the risk rules matched (as the service writes
        # them now), or format 1
        self.carried = carried
        self._append(KIND_GENESIS, OPERATOR, initial, None)

    def _append(
        self,
        kind: str,
        node_id: str,
        patch: JsonObject,
        receipt: tuple[bytes, str] | None,
        *,
        policy_digest: str = POLICY.digest,
        rules: Sequence[str] = (),
    ) -> LedgerRow:
        version = len(self.rows)
        state = apply_patch(self.state, patch)
        state_bytes = canonical_bytes(state)
        committed_at = T0 + timedelta(minutes=version)
        sealed = seal(
            build_record(
                kind=kind,
                thread_id=self.thread_id,
                version=version,
                parent_digest=self.rows[-1].digest if self.rows else GENESIS_PARENT,
                node_id=node_id,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy_digest,
                receipt_digest=sha256_hex(receipt[0]) if receipt else None,
                key_id="k1",
                committed_at=committed_at,
                risk_rules=(rules if receipt else ()) if self.carried else None,
            ),
            KEYRING,
        )
        row = LedgerRow(
            thread_id=self.thread_id,
            version=version,
            digest=sealed.digest,
            parent_digest=sealed.record["parent_digest"],
            node_id=node_id,
            key_id="k1",
            signature=sealed.signature,
            record=sealed.record_bytes,
            state=state_bytes,
            receipt=receipt[0] if receipt else None,
            receipt_signature=receipt[1] if receipt else None,
            receipt_key_id="approval-k1" if receipt else None,
            committed_at=format_time(committed_at),
        )
        self.rows.append(row)
        self.state = state
        return row

    def propose(
        self,
        patch: JsonObject,
        *,
        approved: bool = False,
        rules: Sequence[str] = ("target-user-change",),
        policy_digest: str = POLICY.digest,
        **receipt_changes: Any,
    ) -> LedgerRow:
        receipt = self.receipt(patch, rules, **receipt_changes) if approved else None
        return self._append(
            KIND_TRANSITION, PLANNER, patch, receipt, policy_digest=policy_digest, rules=rules
        )

    def receipt(self, patch: JsonObject, rules: Sequence[str], **changes: Any) -> tuple[bytes, str]:
        """A receipt for ``patch`` as the next transition, as the approval service signs it."""
        base = len(self.rows) - 1
        proposal = build_proposal(
            thread_id=self.thread_id,
            base_version=base,
            parent_digest=self.rows[-1].digest,
            node_id=PLANNER,
            patch=patch,
            state_digest=sha256_hex(canonical_bytes(apply_patch(self.state, patch))),
            policy_digest=POLICY.digest,
            risk_rules=rules,
        )
        committed_at = T0 + timedelta(minutes=base + 1)
        fields: dict[str, Any] = {
            "transition_digest": sha256_hex(canonical_bytes(proposal)),
            "thread_id": self.thread_id,
            "base_version": base,
            "decision": "approve",
            "reviewers": ["spiffe://ztate.test/reviewer/alice"],
            "issued_at": committed_at - timedelta(seconds=30),
            "expires_at": committed_at + timedelta(minutes=5),
            "key_id": "approval-k1",
        }
        fields.update(changes)
        signed = sign_receipt(build_receipt(**fields), APPROVAL_KEY)
        return signed.receipt_bytes, signed.signature


def initial() -> JsonObject:
    return {
        "raw_text": "refund order A-42",
        "authority": {"tenant": "acme"},
        "target_user_id": USER,
    }


def verify_rows(rows: Sequence[LedgerRow], trust: Trust = TRUST) -> tuple[list[Finding], Summary]:
    findings: list[Finding] = []
    run = Verification(trust, findings.append)
    thread = run.thread(THREAD)
    for row in rows:
        thread.add(row)
    return findings, run.summary


def where(findings: Sequence[Finding]) -> set[tuple[int | None, str]]:
    return {(f.version, f.check) for f in findings}


def honest_chain(thread_id: str = THREAD) -> Chain:
    chain = Chain(initial(), thread_id)
    chain.propose({"pending_transition": {"action": "refund", "order_id": "A-42"}})
    chain.propose(RISKY, approved=True)
    chain.propose({"pending_transition": None})
    return chain


# --- the records ----------------------------------------------------------------------


def test_an_honest_chain_with_an_approved_transition_verifies() -> None:
    findings, summary = verify_rows(honest_chain().rows)
    assert findings == []
    assert (summary.threads, summary.records, summary.failures, summary.exit_code) == (1, 4, 0, 0)


def test_pruned_state_bodies_still_verify_by_replay() -> None:
    rows = [dataclasses.replace(row, state=None) for row in honest_chain().rows]
    assert verify_rows(rows)[0] == []


def test_a_risky_transition_without_a_receipt_is_found() -> None:
    chain = Chain(initial())
    chain.propose(RISKY)
    findings, summary = verify_rows(chain.rows)
    assert where(findings) == {(1, "risk")}
    assert "target-user-change" in findings[0].expected
    assert summary.exit_code == 1


def test_a_receipt_expired_at_commit_time_is_found() -> None:
    chain = Chain(initial())
    chain.propose(RISKY, approved=True, expires_at=T0 + timedelta(seconds=30))
    assert where(verify_rows(chain.rows)[0]) == {(1, "receipt.expired")}


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({"base_version": 7}, "base_version"),
        ({"thread_id": "another-thread"}, "thread_id"),
        ({"decision": "reject"}, "decision"),
        ({"transition_digest": "ab" * 32}, "transition_digest"),
    ],
)
def test_a_receipt_for_another_transition_is_found(changes: dict[str, Any], member: str) -> None:
    chain = Chain(initial())
    chain.propose(RISKY, approved=True, **changes)
    findings = verify_rows(chain.rows)[0]
    assert where(findings) == {(1, "receipt.binding")}
    assert findings[0].expected.startswith(member)


def test_a_receipt_approving_other_risk_rules_binds_another_transition() -> None:
    chain = Chain(initial())
    chain.propose(RISKY, approved=True, rules=["large-refund"])
    assert where(verify_rows(chain.rows)[0]) == {(1, "receipt.binding")}


def test_a_receipt_under_an_unknown_approval_key_is_found() -> None:
    rows = honest_chain().rows
    no_keys = Trust(KEYRING, {}, POLICIES)
    assert where(verify_rows(rows, no_keys)[0]) == {(2, "receipt.signature")}


def test_an_unknown_policy_digest_is_found() -> None:
    chain = Chain(initial())
    chain.propose(
        {"pending_transition": {"action": "lookup", "order_id": "A-1"}}, policy_digest="0" * 64
    )
    findings = verify_rows(chain.rows)[0]
    assert where(findings) == {(1, "policy")}
    assert POLICY.digest in findings[0].expected


def test_an_unknown_key_id_and_a_non_canonical_record_are_found() -> None:
    chain = honest_chain()
    record = orjson.loads(chain.rows[1].record)
    spaced = json.dumps(record).encode()  # valid JSON, not RFC 8785
    digest = sha256_hex(spaced)
    chain.rows[1] = dataclasses.replace(
        chain.rows[1],
        record=spaced,
        digest=digest,
        signature=sign_digest(KEYRING.key("k1"), digest),
    )
    other = Keyring.from_json(
        json.dumps({"current": "k9", "keys": {"k9": base64.b64encode(bytes(32)).decode()}}),
        source="test",
    )
    findings = verify_rows(chain.rows, Trust(other, TRUST.approval_keys, POLICIES))[0]
    # the re-written record no longer has the digest its child links to
    assert where(findings) == {(1, "canonical"), (2, "parent")} | {(v, "key_id") for v in range(4)}


def test_risk_rules_matched_once_are_shared_by_every_record_with_the_same_inputs() -> None:
    """The memo of matched risk rules hands its entry to every later record reading the
    same inputs as it is, with no copy per record: so the entry is a tuple, which no
    caller can change under the next one."""
    chain = Chain(initial())
    chain.propose({"pending_transition": {"action": "refund", "order_id": "A-42"}})
    chain.propose({"pending_transition": {"action": "refund", "order_id": "A-43"}})
    run = Verification(TRUST, [].append)
    thread = run.thread(THREAD)
    for row in chain.rows:
        thread.add(row)

    assert run.summary.failures == 0
    # both transitions read the same risk inputs: one entry, matching no rule
    assert list(run.risk_memo.values()) == [()]


def test_a_signature_column_beyond_ascii_is_a_finding_not_a_crash() -> None:
    """hmac.compare_digest refuses str beyond ASCII: the verifier compares bytes."""
    chain = honest_chain()
    for signature in ("é" * 64, chain.rows[1].signature[:-1] + "\u0660", "\ud800"):
        rows = list(chain.rows)
        rows[1] = dataclasses.replace(rows[1], signature=signature)
        findings, summary = verify_rows(rows)
        assert where(findings) == {(1, "signature")}, findings
        assert summary.records == len(rows)


def test_bytes_that_are_no_record_are_reported_not_raised() -> None:
    chain = honest_chain()
    for junk in (b"", b"[1]", b"\xff\xfe", b'{"format": 1e400}', b"{" * 5000):
        rows = list(chain.rows)
        rows[1] = dataclasses.replace(rows[1], record=junk)
        findings = verify_rows(rows)[0]
        assert (1, "canonical") in where(findings), junk[:10]
        assert all(f.version == 1 for f in findings), findings


# --- bundles --------------------------------------------------------------------------


def write(folder: Path, rows: Sequence[LedgerRow]) -> Path:
    with BundleWriter(folder) as writer:
        for row in rows:
            writer.add(row)
        writer.finish({THREAD: (rows[-1].version, rows[-1].digest)})
    return folder


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
def jobs(request: pytest.FixtureRequest) -> int:
    """Every bundle test runs in one process and on worker processes (--jobs 2)."""
    jobs: int = request.param
    return jobs


def check(folder: Path, jobs: int = 1) -> tuple[list[Finding], Summary]:
    findings: list[Finding] = []
    if jobs == 1:
        summary = verify_bundle(folder, TRUST, findings.append)
    else:
        summary = verify_bundle_parallel(folder, TRUST, findings.append, jobs=jobs)
    return findings, summary


def rewrite(folder: Path, lines: list[bytes], *, fix_manifest: bool) -> None:
    data = b"".join(lines)
    (folder / RECORDS).write_bytes(data)
    if fix_manifest:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["records_sha256"] = sha256_hex(data)
        manifest["records"] = len(lines)
        (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_bundle_round_trip_verifies(tmp_path: Path, jobs: int) -> None:
    findings, summary = check(write(tmp_path, honest_chain().rows), jobs)
    assert findings == []
    assert (summary.threads, summary.records) == (1, 4)


def test_an_existing_bundle_is_never_overwritten(tmp_path: Path) -> None:
    write(tmp_path, honest_chain().rows)
    with pytest.raises(BundleError, match="already holds a bundle"):
        BundleWriter(tmp_path)


def test_lines_swapped_in_a_bundle_are_pinpointed(tmp_path: Path, jobs: int) -> None:
    folder = write(tmp_path, honest_chain().rows)
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]
    rewrite(folder, lines, fix_manifest=True)
    findings = check(folder, jobs)[0]
    assert where(findings) == {(1, "version")}
    assert len(findings) == 2  # version 1 missing where 2 stands, then version 1 out of place


def test_a_blank_line_and_a_split_thread_are_reported(tmp_path: Path, jobs: int) -> None:
    chain = honest_chain()
    other = [dataclasses.replace(row, thread_id="zz-other") for row in chain.rows[:1]]
    folder = tmp_path / "b"
    with BundleWriter(folder) as writer:
        for row in [*chain.rows[:2], *other, *chain.rows[2:]]:
            writer.add(row)
        writer.finish({THREAD: (3, chain.rows[3].digest), "zz-other": (0, other[0].digest)})
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rewrite(folder, [*lines, b"\n"], fix_manifest=True)
    findings = check(folder, jobs)[0]
    checks = {(f.thread_id, f.check) for f in findings}
    assert (None, BUNDLE_LINE) in checks
    assert (THREAD, BUNDLE_ORDER) in checks
    assert ("zz-other", "thread_id") in checks  # its record names another thread


def test_a_bundle_edited_without_its_manifest_fails_the_file_hash(
    tmp_path: Path, jobs: int
) -> None:
    folder = write(tmp_path, honest_chain().rows)
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    rewrite(folder, lines[:-1], fix_manifest=False)  # the head record removed
    findings = check(folder, jobs)[0]
    assert {(f.version, f.check) for f in findings} == {
        (None, BUNDLE_HASH),
        (None, BUNDLE_COUNT),
        (3, "head"),
    }


CHECKPOINT_KEY = Ed25519PrivateKey.generate()
SIGNED_TRUST = dataclasses.replace(TRUST, checkpoint_keys={"cp-1": CHECKPOINT_KEY.public_key()})
SIGNED = f"a {MANIFEST} whose SHA-256 a checkpoint key signed ({MANIFEST_SIG})"


def signed_check(folder: Path, jobs: int) -> tuple[list[Finding], Summary]:
    findings: list[Finding] = []
    if jobs == 1:
        summary = verify_bundle(folder, SIGNED_TRUST, findings.append)
    else:
        summary = verify_bundle_parallel(folder, SIGNED_TRUST, findings.append, jobs=jobs)
    return findings, summary


def test_the_manifest_signature_covers_the_manifest_bytes_verified_not_a_second_read(
    tmp_path: Path, jobs: int
) -> None:
    """manifest.json answers its first read with a forged manifest (the head record
    removed from records.jsonl, the manifest's hash, count and head rewritten to match)
    and any later read with the genuine, signed one: a file system the bundle's editor
    serves (a share, a FUSE mount) can do so. The signature must be checked over the
    bytes verified: before, the manifest was read again to hash it, and the truncated
    ledger verified clean under a valid signature."""
    chain = honest_chain()
    folder = tmp_path / "bundle"
    with BundleWriter(folder) as writer:
        for row in chain.rows:
            writer.add(row)
        writer.finish(
            {THREAD: (chain.rows[-1].version, chain.rows[-1].digest)},
            signer=("cp-1", CHECKPOINT_KEY),
        )
    genuine = (folder / MANIFEST).read_bytes()
    assert signed_check(folder, jobs)[0] == []  # as exported: its signature verifies
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)[:-1]
    (folder / RECORDS).write_bytes(b"".join(lines))
    doc = json.loads(genuine)
    doc["records"], doc["records_sha256"] = 3, sha256_hex(b"".join(lines))
    doc["heads"] = {THREAD: [chain.rows[-2].version, chain.rows[-2].digest]}
    forged = json.dumps(doc).encode()
    (tmp_path / "genuine.json").write_bytes(genuine)
    (folder / MANIFEST).unlink()
    os.mkfifo(folder / MANIFEST)

    def serve() -> None:
        with (folder / MANIFEST).open("wb") as pipe:  # waits for the first read's open
            # the path names the genuine manifest from now on; the first read, which
            # holds the pipe, gets the forged one
            (tmp_path / "genuine.json").replace(folder / MANIFEST)
            pipe.write(forged)

    server = threading.Thread(target=serve)
    server.start()
    try:
        findings, summary = signed_check(folder, jobs)
    finally:
        server.join()

    assert findings == [
        Finding(
            None,
            None,
            BUNDLE_MANIFEST,
            SIGNED,
            f"the signature covers a manifest with SHA-256 {sha256_hex(genuine)}, "
            f"not this one ({sha256_hex(forged)})",
        )
    ]
    assert (summary.records, summary.exit_code) == (3, 1)


def test_a_manifest_signature_too_long_to_be_one_is_read_no_further(
    tmp_path: Path, jobs: int
) -> None:
    """A manifest.sig of 64 KiB and more is no signature: one finding, and at most one
    byte past the bound is read (a bundle's editor could make it endless)."""
    folder = write(tmp_path / "bundle", honest_chain().rows)
    (folder / MANIFEST_SIG).write_bytes(b" " * (MAX_MANIFEST_SIG + 1))
    findings, summary = signed_check(folder, jobs)
    assert findings == [
        Finding(
            None,
            None,
            BUNDLE_MANIFEST,
            SIGNED,
            f"a {MANIFEST_SIG} longer than {MAX_MANIFEST_SIG:,} bytes",
        )
    ]
    assert summary.exit_code == 1
    (folder / MANIFEST_SIG).unlink()
    (folder / MANIFEST_SIG).symlink_to("/dev/zero")  # endless: the same finding
    assert signed_check(folder, jobs)[0] == findings


def test_an_unusable_manifest_means_verification_cannot_run(tmp_path: Path) -> None:
    folder = write(tmp_path, honest_chain().rows)
    (folder / MANIFEST).write_text('{"format": 1}')
    with pytest.raises(BundleError):
        check(folder)
    with pytest.raises(BundleError):
        check(tmp_path / "missing")


def test_a_line_too_long_is_reported_and_never_held(
    tmp_path: Path, jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line over ``bundle.MAX_LINE`` (512 MiB; here 4 KiB, read in 1 KiB blocks) is
    hashed and counted but not read: one ``bundle.line`` finding, and the chain goes on
    as after any line that is no row (before, it was held whole, however long: here it
    is a valid row padded with blanks, which verified)."""
    monkeypatch.setattr(bundle, "MAX_LINE", 4096)
    monkeypatch.setattr(bundle, "BLOCK", 1024)
    monkeypatch.setattr(parallel, "BLOCK", 1024)
    folder = write(tmp_path, honest_chain().rows)
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    assert max(map(len, lines)) < 4096
    lines[2] = lines[2][:-1] + b" " * 5000 + b"\n"
    rewrite(folder, lines, fix_manifest=True)
    findings = check(folder, jobs)[0]
    assert [f.found for f in findings if f.check == BUNDLE_LINE] == [
        "line 3: too long (over 4096 bytes): not read"
    ]
    assert where(findings) == {(None, BUNDLE_LINE), (2, "version")}  # 2 missing, 3 found


def test_a_reader_holds_no_more_of_an_endless_line_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 MiB without a newline (a records.jsonl that is one line, or a device that
    never ends one): the reader hashes all of it and hands out ``TOO_LONG``, holding
    at most ``MAX_LINE`` (here 64 KiB) of it at any time."""
    monkeypatch.setattr(bundle, "MAX_LINE", 64 * 1024)
    blocks = (b"x" * 65536 for _ in range(1600))
    hashed = hashlib.sha256()
    tracemalloc.start()
    try:
        reader = LineReader(blocks, 1, Path("records.jsonl"), hashed.update)
        number, line = next(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (number, line) == (1, b"")
    assert line is TOO_LONG
    assert peak < 1024 * 1024
    assert hashed.hexdigest() == hashlib.sha256(b"x" * 65536 * 1600).hexdigest()
    with pytest.raises(StopIteration):
        next(reader)


def test_a_broken_line_inside_a_thread_is_reported_with_its_line_number(
    tmp_path: Path, jobs: int
) -> None:
    """The line starts like a row (so workers get it with its neighbours) but is not
    JSON: its number must be the file's, in one process and on workers alike."""
    folder = write(tmp_path, honest_chain().rows)
    lines = (folder / RECORDS).read_bytes().splitlines(keepends=True)
    lines[2] = lines[2][: lines[2].index(b',"digest"')] + b",broken\n"
    rewrite(folder, lines, fix_manifest=True)
    findings = check(folder, jobs)[0]
    assert [f.found for f in findings if f.check == BUNDLE_LINE] == ["line 3: not JSON"]
    assert where(findings) == {(None, BUNDLE_LINE), (2, "version")}  # 2 missing, 3 found
