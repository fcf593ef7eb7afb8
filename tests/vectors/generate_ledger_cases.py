"""How tests/vectors/ledger/ was made: a conformance suite for ledger verifiers.

One folder per case under ``cases/``, each a complete bundle (docs/verification.md,
"Bundles") of a small ledger: two threads written as the transition service writes
them (format-2 records, an approved transition with its receipt, a signed
checkpoint), then tampered with in one way. ``expected.json`` names, for each case,
the arguments ``ztate verify`` is given besides the key files, the exit code and the
exact findings as ``[thread, version, check]``: for each thread, in order; those of
no thread, sorted by check (docs/verification.md, "Reporting rules").

Everything is fixed (keys from constant seeds, times, nonces; Ed25519 signs
deterministically), so the script rebuilds the same bytes; the test
(tests/unit/test_ledger_conformance.py) checks that, then runs ``ztate verify`` on
each case. The keys are test keys, published here, never anyone's:

    .venv/bin/python -m tests.vectors.generate_ledger_cases --write
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.checkpoints import SignedCheckpoint, sign_checkpoint
from ztate.contract.keyring import Keyring
from ztate.contract.receipts import build_receipt, sign_receipt
from ztate.contract.record import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    build_proposal,
    build_record,
    seal,
    sign_digest,
)
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import Policy
from ztate.services.store.policies import StoredPolicy
from ztate.services.verify.bundle import MANIFEST_SIG, BundleWriter
from ztate.services.verify.checks import LedgerRow

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("ledger")
# The suite's own policy (a frozen copy of the pipeline policy the vectors were made
# with): the shipped default may change, the vectors' bytes must not.
POLICY_FILE = OUT / "policy.yaml"
POLICY = Policy.load(POLICY_FILE)
POLICY_TEXT = POLICY_FILE.read_text(encoding="utf-8")  # kept: write() empties OUT first

HMAC_KEY_ID, HMAC_KEY = "conformance-k1", bytes(range(32))
KEYRING = Keyring.from_json(
    json.dumps(
        {"current": HMAC_KEY_ID, "keys": {HMAC_KEY_ID: base64.b64encode(HMAC_KEY).decode()}}
    ),
    source="conformance",
)
APPROVAL_KEY_ID, APPROVAL_KEY = "approval-k1", Ed25519PrivateKey.from_private_bytes(b"\x01" * 32)
CHECKPOINT_KEY_ID = "checkpoint-k1"
CHECKPOINT_KEY = Ed25519PrivateKey.from_private_bytes(b"\x02" * 32)

A, B = "conformance-a", "conformance-b"  # A: checkpointed at version 3; B: approved head
DOMAIN = "spiffe://ztate.test"
OPERATOR, PARSER = f"{DOMAIN}/operator/admin", f"{DOMAIN}/node/input-parser"
PLANNER, GATE = f"{DOMAIN}/node/planner", f"{DOMAIN}/node/approval-gate"
REVIEWER = f"{DOMAIN}/reviewer/alice"
USER, OTHER_USER = "123e4567-e89b-42d3-a456-426614174000", "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
T0 = datetime(2026, 3, 1, 12, 0, 0, 0, tzinfo=UTC)
CREATED_AT = datetime(2026, 3, 1, 13, 0, 0, 0, tzinfo=UTC)
INITIAL: JsonObject = {
    "raw_text": "please refund order A-42",
    "authority": {"tenant": "acme"},
    "target_user_id": USER,
}
PLAN: JsonObject = {"action": "refund", "order_id": "A-42", "amount_cents": 1200}
# thread A's steps after genesis: (node, patch)
STEPS_A: list[tuple[str, JsonObject]] = [
    (PARSER, {"requested_action": {"action": "refund", "order_id": "A-42"}}),
    (PLANNER, {"pending_transition": PLAN}),
    (GATE, {"execution_permissions": []}),
    (PARSER, {"requested_action": {"action": "lookup", "order_id": "A-42"}}),
]
CHECKPOINTED = 3  # thread A's signed head


@dataclasses.dataclass
class Thread:
    """One thread's rows and the states after each, as written."""

    thread_id: str
    rows: list[LedgerRow]
    states: list[JsonObject]
    form: int


@dataclasses.dataclass
class Ledger:
    threads: dict[str, Thread]
    checkpoints: list[tuple[str, int, SignedCheckpoint]]

    def rows(self) -> list[LedgerRow]:
        return [row for thread_id in sorted(self.threads) for row in self.threads[thread_id].rows]

    def heads(self) -> dict[str, tuple[int, str]]:
        """The heads as the attacker leaves them: the last row of each thread."""
        return {
            thread_id: (thread.rows[-1].version, thread.rows[-1].digest)
            for thread_id, thread in self.threads.items()
            if thread.rows
        }


def committed_at(thread_id: str, version: int) -> datetime:
    return T0 + timedelta(minutes=version, seconds=0 if thread_id == A else 30)


def record_of(row: LedgerRow) -> JsonObject:
    record: JsonObject = json.loads(row.record)
    return record


def sealed_row(record: JsonObject, state: JsonObject | None, receipt: Any = None) -> LedgerRow:
    sealed = seal(record, KEYRING)
    return LedgerRow(
        thread_id=record["thread_id"],
        version=record["version"],
        digest=sealed.digest,
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        key_id=record["key_id"],
        signature=sealed.signature,
        record=sealed.record_bytes,
        state=None if state is None else canonical_bytes(state),
        receipt=None if receipt is None else receipt.receipt_bytes,
        receipt_signature=None if receipt is None else receipt.signature,
        receipt_key_id=None if receipt is None else receipt.key_id,
        committed_at=record["committed_at"],
    )


def write_thread(
    thread_id: str, steps: list[tuple[str, JsonObject]], *, form: int, approved: int | None
) -> Thread:
    """Genesis and ``steps``; the step at version ``approved`` matched target-user-change
    and commits under a receipt."""
    rows: list[LedgerRow] = []
    states: list[JsonObject] = []
    state: JsonObject = {}
    for version, (node, patch) in enumerate([(OPERATOR, INITIAL), *steps]):
        old, state = state, apply_patch(state, patch)
        rules = ["target-user-change"] if version == approved else []
        parent = rows[-1].digest if rows else GENESIS_PARENT
        receipt = None
        if version == approved:
            receipt = approval(thread_id, version, parent, node, patch, state, rules)
        record = build_record(
            kind=KIND_GENESIS if version == 0 else KIND_TRANSITION,
            thread_id=thread_id,
            version=version,
            parent_digest=parent,
            node_id=node,
            patch=patch,
            state_digest=sha256_hex(canonical_bytes(state)),
            policy_digest=POLICY.digest,
            receipt_digest=None if receipt is None else receipt.digest,
            key_id=HMAC_KEY_ID,
            committed_at=committed_at(thread_id, version),
            risk_rules=None if form == 1 else rules,
        )
        rows.append(sealed_row(record, state, receipt))
        states.append(state)
        del old
    return Thread(thread_id, rows, states, form)


def approval(
    thread_id: str,
    version: int,
    parent: str,
    node: str,
    patch: JsonObject,
    state: JsonObject,
    rules: list[str],
    *,
    expires_in: timedelta = timedelta(minutes=5),
    nonce: str = "00112233445566778899aabbccddeeff",
    transition_digest: str | None = None,
) -> Any:
    proposal = build_proposal(
        thread_id=thread_id,
        base_version=version - 1,
        parent_digest=parent,
        node_id=node,
        patch=patch,
        state_digest=sha256_hex(canonical_bytes(state)),
        policy_digest=POLICY.digest,
        risk_rules=rules,
    )
    at = committed_at(thread_id, version)
    receipt = build_receipt(
        transition_digest=transition_digest or sha256_hex(canonical_bytes(proposal)),
        thread_id=thread_id,
        base_version=version - 1,
        decision="approve",
        reviewers=[REVIEWER],
        issued_at=at - timedelta(minutes=2),
        expires_at=at - timedelta(minutes=2) + expires_in,
        key_id=APPROVAL_KEY_ID,
        nonce=nonce,
    )
    return sign_receipt(receipt, APPROVAL_KEY)


def honest(form: int = 2) -> Ledger:
    thread_a = write_thread(A, STEPS_A, form=form, approved=None)
    thread_b = write_thread(
        B,
        [
            (PARSER, {"requested_action": {"action": "refund", "order_id": "B-7"}}),
            (PLANNER, {"target_user_id": OTHER_USER}),
        ],
        form=form,
        approved=2,
    )
    head = thread_a.rows[CHECKPOINTED]
    checkpoint = sign_checkpoint(
        CHECKPOINT_KEY,
        CHECKPOINT_KEY_ID,
        thread_id=A,
        version=CHECKPOINTED,
        head_digest=head.digest,
        signed_at=committed_at(A, CHECKPOINTED) + timedelta(seconds=5),
    )
    return Ledger({A: thread_a, B: thread_b}, [(A, CHECKPOINTED, checkpoint)])


# --- ways to tamper -------------------------------------------------------------------


def edit_record(row: LedgerRow, *, digest: bool, sign: bool, **changes: Any) -> LedgerRow:
    """``row`` with record members changed; its digest recomputed if ``digest``, its
    HMAC recomputed too if ``sign`` (an attacker with the key)."""
    record = {**record_of(row), **changes}
    data = canonical_bytes(record)
    new_digest = sha256_hex(data) if digest else row.digest
    signature = sign_digest(HMAC_KEY, new_digest) if sign else row.signature
    return dataclasses.replace(row, record=data, digest=new_digest, signature=signature)


def rewrite_from(
    ledger: Ledger, thread_id: str, version: int, patch: JsonObject, *, sign: bool
) -> None:
    """A consistent rewrite: the patch at ``version`` replaced, every later state,
    digest and parent recomputed; signatures recomputed only with the key."""
    thread = ledger.threads[thread_id]
    state = thread.states[version - 1]
    for index in range(version, len(thread.rows)):
        row = thread.rows[index]
        record = record_of(row)
        if index == version:
            record["patch"] = patch
        state = apply_patch(state, record["patch"])
        record["state_digest"] = sha256_hex(canonical_bytes(state))
        record["parent_digest"] = thread.rows[index - 1].digest
        data = canonical_bytes(record)
        digest = sha256_hex(data)
        thread.rows[index] = dataclasses.replace(
            row,
            record=data,
            digest=digest,
            parent_digest=record["parent_digest"],
            signature=sign_digest(HMAC_KEY, digest) if sign else row.signature,
            state=canonical_bytes(state),
        )


def replace_row(ledger: Ledger, thread_id: str, version: int, row: LedgerRow) -> None:
    ledger.threads[thread_id].rows[version] = row


def t_state(ledger: Ledger) -> None:
    row = ledger.threads[A].rows[2]
    replace_row(ledger, A, 2, dataclasses.replace(row, state=b'{"raw_text":"edited"}'))


def t_patch(ledger: Ledger) -> None:
    row = ledger.threads[A].rows[2]
    edited = {"pending_transition": {**PLAN, "amount_cents": 990000}}
    replace_row(ledger, A, 2, edit_record(row, digest=False, sign=False, patch=edited))


def t_node_id(ledger: Ledger) -> None:
    row = ledger.threads[A].rows[2]
    replace_row(
        ledger, A, 2, edit_record(row, digest=False, sign=False, node_id=f"{DOMAIN}/node/db-writer")
    )


def t_parent(ledger: Ledger) -> None:
    thread = ledger.threads[A]
    other = thread.rows[2].digest
    row = edit_record(thread.rows[4], digest=True, sign=True, parent_digest=other)
    replace_row(ledger, A, 4, dataclasses.replace(row, parent_digest=other))


def t_signature_bit(ledger: Ledger) -> None:
    row = ledger.threads[A].rows[1]
    flipped = row.signature[:-1] + format(int(row.signature[-1], 16) ^ 1, "x")
    replace_row(ledger, A, 1, dataclasses.replace(row, signature=flipped))


def t_deleted(ledger: Ledger) -> None:
    del ledger.threads[A].rows[2]


def t_forked(ledger: Ledger) -> None:
    thread = ledger.threads[A]
    twin = edit_record(
        thread.rows[2],
        digest=True,
        sign=True,
        patch={"pending_transition": {**PLAN, "amount_cents": 5}},
        state_digest=sha256_hex(
            canonical_bytes(
                apply_patch(thread.states[1], {"pending_transition": {**PLAN, "amount_cents": 5}})
            )
        ),
    )
    twin = dataclasses.replace(
        twin,
        state=canonical_bytes(
            apply_patch(thread.states[1], {"pending_transition": {**PLAN, "amount_cents": 5}})
        ),
    )
    thread.rows.insert(3, twin)


def t_swapped(ledger: Ledger) -> None:
    rows = ledger.threads[A].rows
    rows[1], rows[2] = rows[2], rows[1]


def t_replaced_receipt(ledger: Ledger) -> None:
    row = ledger.threads[B].rows[2]
    other = approval(
        B,
        2,
        row.parent_digest,
        PLANNER,
        {"target_user_id": USER},
        ledger.threads[B].states[1],
        ["target-user-change"],
        nonce="ffeeddccbbaa99887766554433221100",
    )
    replace_row(
        ledger,
        B,
        2,
        dataclasses.replace(row, receipt=other.receipt_bytes, receipt_signature=other.signature),
    )


def t_expired_receipt(ledger: Ledger) -> None:
    thread = ledger.threads[B]
    row = thread.rows[2]
    expired = approval(
        B,
        2,
        row.parent_digest,
        PLANNER,
        {"target_user_id": OTHER_USER},
        thread.states[2],
        ["target-user-change"],
        expires_in=timedelta(minutes=1),  # issued 2 minutes before the commit
    )
    row = edit_record(row, digest=True, sign=True, receipt_digest=expired.digest)
    replace_row(
        ledger,
        B,
        2,
        dataclasses.replace(
            row, receipt=expired.receipt_bytes, receipt_signature=expired.signature
        ),
    )


def t_wrong_key_id(ledger: Ledger) -> None:
    row = edit_record(ledger.threads[A].rows[4], digest=True, sign=True, key_id="conformance-k9")
    replace_row(ledger, A, 4, dataclasses.replace(row, key_id="conformance-k9"))


def t_rewrite_without_key(ledger: Ledger) -> None:
    rewrite_from(ledger, A, 2, {"pending_transition": {**PLAN, "amount_cents": 990000}}, sign=False)


def t_rewrite_with_key(ledger: Ledger) -> None:
    rewrite_from(ledger, A, 2, {"pending_transition": {**PLAN, "amount_cents": 990000}}, sign=True)


def t_non_canonical(ledger: Ledger) -> None:
    row = ledger.threads[A].rows[4]
    spaced = row.record.replace(b'"format":2,', b'"format": 2,', 1)
    assert spaced != row.record
    digest = sha256_hex(spaced)
    replace_row(
        ledger,
        A,
        4,
        dataclasses.replace(
            row, record=spaced, digest=digest, signature=sign_digest(HMAC_KEY, digest)
        ),
    )


def t_role_kind(ledger: Ledger) -> None:
    row = edit_record(ledger.threads[A].rows[4], digest=True, sign=True, node_id=OPERATOR)
    replace_row(ledger, A, 4, dataclasses.replace(row, node_id=OPERATOR))


def t_none(ledger: Ledger) -> None:
    return None


Finding = list[Any]  # [thread, version, check]


@dataclasses.dataclass(frozen=True)
class Case:
    why: str
    tamper: Callable[[Ledger], None]
    findings: list[Finding]
    form: int = 2
    args: tuple[str, ...] = ()
    # manifest.sig: "none"; "own" (the checkpoint key signed this bundle's manifest, as
    # ztate ledger export does beside the key); "honest" (the signature the untampered
    # bundle was exported with, kept by an attacker who rewrote the manifest)
    signature: str = "none"


CASES: dict[str, Case] = {
    "clean": Case(
        "the ledger as the service wrote it, its manifest signed with the checkpoint key",
        t_none,
        [],
        signature="own",
    ),
    "manifest-rewritten": Case(
        "a record removed and the manifest rewritten to match: the signature over the"
        " manifest, made at export, no longer covers it",
        t_deleted,
        [[A, 2, "version"], [None, None, "bundle.manifest"]],
        signature="honest",
    ),
    "manifest-signature-removed": Case(
        "the untampered ledger without its manifest.sig, verified with --signed-manifest",
        t_none,
        [[None, None, "bundle.manifest"]],
        args=("--signed-manifest",),
    ),
    "clean-format-1": Case(
        "the same ledger in record format 1 (no risk_rules): verifiers read both",
        t_none,
        [],
        form=1,
    ),
    "state": Case("a kept state body replaced", t_state, [[A, 2, "state"]]),
    "patch": Case(
        "a record's patch edited in place (digest and HMAC left stale)",
        t_patch,
        [[A, 2, "digest"], [A, 2, "replay"]],
    ),
    "node-id": Case(
        "a record's node_id edited in place",
        t_node_id,
        [[A, 2, "digest"], [A, 2, "column.node_id"]],
    ),
    "parent": Case(
        "the head re-parented onto an older record, re-signed with the HMAC key",
        t_parent,
        [[A, 4, "parent"]],
    ),
    "signature-bit": Case(
        "one bit of a record's HMAC flipped", t_signature_bit, [[A, 1, "signature"]]
    ),
    "deleted": Case("a record removed from the middle", t_deleted, [[A, 2, "version"]]),
    "forked": Case(
        "a second record on the same parent (a fork), signed with the key",
        t_forked,
        [[A, 2, "version"]],  # the twin is checked alone; the chain goes on from the first
    ),
    "swapped": Case(
        "two records' lines swapped",
        t_swapped,
        # version 2 first: 1 is missing; then version 1 again, checked alone
        [[A, 1, "version"], [A, 1, "version"]],
    ),
    "replaced-receipt": Case(
        "the stored receipt replaced by a valid one for another transition",
        t_replaced_receipt,
        [[B, 2, "receipt.digest"], [B, 2, "receipt.binding"]],
    ),
    "expired-receipt": Case(
        "a receipt that had expired when the transition committed",
        t_expired_receipt,
        [[B, 2, "receipt.expired"]],
    ),
    "wrong-key-id": Case(
        "the head names an HMAC key id the keyring does not hold",
        t_wrong_key_id,
        [[A, 4, "key_id"]],
    ),
    "rewrite-without-key": Case(
        "history rewritten consistently from version 2, without the HMAC key",
        t_rewrite_without_key,
        [[A, 2, "signature"], [A, 3, "checkpoint"], [A, 3, "signature"], [A, 4, "signature"]],
    ),
    "rewrite-with-key": Case(
        "history rewritten consistently from version 2 and re-signed with the HMAC key:"
        " only the signed checkpoint at version 3 catches it",
        t_rewrite_with_key,
        [[A, 3, "checkpoint"]],
    ),
    "rewrite-with-key-public-only": Case(
        "the same rewrite, verified with public keys alone (--public-only)",
        t_rewrite_with_key,
        [[A, 3, "checkpoint"]],
        args=("--public-only",),
    ),
    "non-canonical": Case(
        "the head's record bytes with one space added, rehashed and re-signed",
        t_non_canonical,
        [[A, 4, "canonical"]],
    ),
    "role-kind": Case(
        "a transition written under an operator identity, re-signed with the key",
        t_role_kind,
        [[A, 4, "role"]],
    ),
}


# --- writing --------------------------------------------------------------------------


def public_keys(key_id: str, key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return json.dumps({key_id: base64.b64encode(raw).decode()}, indent=2) + "\n"


def write_bundle(ledger: Ledger, folder: Path, *, signed: bool = False) -> None:
    with BundleWriter(folder) as writer:
        for row in ledger.rows():
            writer.add(row)
        for thread_id, version, checkpoint in sorted(ledger.checkpoints, key=lambda c: c[:2]):
            writer.add_checkpoint(thread_id, version, checkpoint)
        writer.add_policy(StoredPolicy(POLICY.digest, POLICY.name, POLICY.body))
        signer = (CHECKPOINT_KEY_ID, CHECKPOINT_KEY) if signed else None
        writer.finish(ledger.heads(), created_at=CREATED_AT, signer=signer)


def expected() -> dict[str, Any]:
    return {
        "description": (
            "ztate verify --bundle cases/<name> --keyring keys/hmac-keyring.json"
            " --approval-keys keys/approval-public.json --checkpoint-keys"
            " keys/checkpoint-public.json --policy policy.yaml <args>: the exit code and"
            " the findings [thread, version, check], each thread's in order, those of no"
            " thread sorted by check (docs/verification.md)"
        ),
        "cases": {
            name: {
                "why": case.why,
                "args": list(case.args),
                "exit": 1 if case.findings else 0,
                "findings": case.findings,
            }
            for name, case in CASES.items()
        },
    }


def write(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "keys").mkdir(parents=True)
    (out / "keys" / "hmac-keyring.json").write_text(
        json.dumps(
            {"current": HMAC_KEY_ID, "keys": {HMAC_KEY_ID: base64.b64encode(HMAC_KEY).decode()}},
            indent=2,
        )
        + "\n"
    )
    (out / "keys" / "approval-public.json").write_text(public_keys(APPROVAL_KEY_ID, APPROVAL_KEY))
    (out / "keys" / "checkpoint-public.json").write_text(
        public_keys(CHECKPOINT_KEY_ID, CHECKPOINT_KEY)
    )
    (out / "policy.yaml").write_text(POLICY_TEXT, encoding="utf-8")
    with tempfile.TemporaryDirectory() as scratch:
        write_bundle(honest(), Path(scratch) / "honest", signed=True)
        honest_signature = (Path(scratch) / "honest" / MANIFEST_SIG).read_bytes()
    for name, case in CASES.items():
        ledger = honest(case.form)
        case.tamper(ledger)
        folder = out / "cases" / name
        write_bundle(ledger, folder, signed=case.signature == "own")
        if case.signature == "honest":
            (folder / MANIFEST_SIG).write_bytes(honest_signature)
    (out / "expected.json").write_text(json.dumps(expected(), indent=2) + "\n")


def main(argv: list[str]) -> None:
    if argv == ["--write"]:
        write(OUT)
    else:
        raise SystemExit("usage: python -m tests.vectors.generate_ledger_cases --write")


if __name__ == "__main__":
    main(sys.argv[1:])
