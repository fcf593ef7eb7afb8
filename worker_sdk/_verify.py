"""Refusing to act on a head that was not approved: the privileged worker's check."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ztate.contract.canonical import canonical_or_error, sha256_hex
from ztate.contract.checkpoints import SignedCheckpoint, verify_checkpoint
from ztate.contract.errors import ContractError
from ztate.contract.keyring import PublicKeys
from ztate.contract.receipts import SignedReceipt, check_receipt_binds, verify_receipt
from ztate.contract.record import parse_record
from ztate.worker_sdk.client import ZtateClient
from ztate.worker_sdk.errors import ProtocolError

# The server signs checkpoints every ZTATE_CHECKPOINT_INTERVAL_SECONDS (60 by
# default), not on each commit: waiting a little longer than one interval finds
# the checkpoint of a head that was just committed.
DEFAULT_CHECKPOINT_WAIT_SECONDS = 75.0
FIRST_POLL_SECONDS = 0.25
LONGEST_POLL_SECONDS = 5.0


class HeadNotVerified(Exception):
    """The head may not be acted on: ``check`` names what failed (``reply.form``: the
    service answered without what the protocol requires; ``head.moved``,
    ``record.digest``, ``record.form``, ``patch.missing``, ``patch.value``,
    ``receipt.missing``, ``receipt.signature``, ``receipt.form``,
    ``receipt.digest``, ``receipt.binding``, ``receipt.expired``,
    ``checkpoint.missing``, ``checkpoint.signature``, ``checkpoint.form``,
    ``checkpoint.head``), ``message`` says how (never with a state value)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message


@dataclass(frozen=True, slots=True)
class VerifiedHead:
    """A head whose approval and checkpoint verified with public keys, and whose
    approved patch set exactly the values the worker acts on.

    ``record`` is the parsed ledger record, ``receipt`` the parsed approval receipt
    (its reviewers, validity and nonce), ``checkpoint`` the parsed signed checkpoint.
    """

    thread_id: str
    version: int
    digest: str
    record: dict[str, Any]
    receipt: dict[str, Any]
    checkpoint: dict[str, Any]


async def verify_head_before_acting(
    client: ZtateClient,
    thread_id: str,
    *,
    expected_version: int,
    acting_on: Mapping[str, Any],
    approval_keys: PublicKeys,
    checkpoint_keys: PublicKeys,
    expected_digest: str | None = None,
    checkpoint_wait: float = DEFAULT_CHECKPOINT_WAIT_SECONDS,
) -> VerifiedHead:
    """Fetch the head of ``thread_id`` now and prove, with public keys only, that a
    reviewer approved the very values the worker is about to act on; raise
    ``HeadNotVerified`` otherwise. The byte formats are checked by ``ztate.contract``,
    the same code the control plane and the offline verifier run.

    ``expected_version`` (and ``expected_digest``, the view's ``head_digest``) name
    the view the worker decided on; ``acting_on`` maps each key it acts on to the
    value it read in that view. Checked: the head is that version (and digest);
    the record hashes to its digest, is in canonical form and is that thread's
    head; its patch set each key of ``acting_on`` to exactly that value (compared
    in RFC 8785 form); it names an approval receipt, which is the one stored with
    it; the receipt's Ed25519 signature under ``approval_keys``, its canonical form
    and its binding to this record (thread, base version, the transition digest
    rebuilt from the record and its matched risk rules, an approval, valid when
    committed); and a checkpoint of this very head signed under
    ``checkpoint_keys``. Any malformed answer is ``HeadNotVerified`` too.

    Checkpoints are signed on a timer (every ``ZTATE_CHECKPOINT_INTERVAL_SECONDS``,
    60 by default), so this waits up to ``checkpoint_wait`` seconds (75 by default:
    one interval and some) for one that covers the head, polling with backoff
    from 0.25 s up to 5 s. Pass a ``checkpoint_wait`` coherent with the server's
    interval.

    Time of check, time of use: the proof holds for the head at the moment it was
    fetched. The head may move right after; the values proven are those of the
    approved version the worker read, so act on exactly ``acting_on`` (not a later
    read) and make the action itself idempotent or conditional on that version.
    """
    if not acting_on:
        raise ValueError("acting_on must name at least one key the worker acts on")
    try:
        found = await client.get_record(thread_id)
    except ProtocolError:  # a reply without its transition, or a transition undated
        raise HeadNotVerified(
            "reply.form", "the service answered GetTransition without a field the protocol requires"
        ) from None
    transition = found.transition
    if transition.version != expected_version:
        raise HeadNotVerified(
            "head.moved", f"the head is at {transition.version}, not {expected_version}"
        )
    if expected_digest is not None and transition.digest != expected_digest:
        raise HeadNotVerified("head.moved", "the head is not the version the worker read")
    if sha256_hex(transition.record_json) != transition.digest:
        raise HeadNotVerified("record.digest", "the record does not hash to its digest")
    try:
        record = parse_record(transition.record_json)
        if (record["thread_id"], record["version"]) != (thread_id, transition.version):
            raise HeadNotVerified("record.digest", "the record is not this thread's head")
        if record["receipt_digest"] is None or found.receipt is None:
            raise HeadNotVerified("receipt.missing", "the head was committed without an approval")
        signed = SignedReceipt(
            found.receipt.receipt_json, found.receipt.signature, found.receipt.key_id
        )
        receipt = verify_receipt(signed, approval_keys, now=None)
        check_receipt_binds(receipt, signed.receipt_bytes, record, list(found.risk_rules))
        _check_approved_values(record["patch"], acting_on)
        body = await _checkpoint_of_head(
            client, thread_id, transition.version, checkpoint_keys, checkpoint_wait
        )
    except ContractError as failed:
        raise HeadNotVerified(failed.check, failed.message) from None
    if (body["thread_id"], body["version"], body["head_digest"]) != (
        thread_id,
        transition.version,
        transition.digest,
    ):
        raise HeadNotVerified("checkpoint.head", "the signed checkpoint names another head")
    return VerifiedHead(thread_id, transition.version, transition.digest, record, receipt, body)


def _check_approved_values(patch: dict[str, Any], acting_on: Mapping[str, Any]) -> None:
    """The approved patch set every key the worker acts on to the value it holds."""
    for key, value in acting_on.items():
        if key not in patch:
            raise HeadNotVerified("patch.missing", f"the approved change did not set {key!r}")
        approved = canonical_or_error(patch[key], ContractError, "record.form")
        if approved != canonical_or_error(value, ContractError, "patch.value"):
            raise HeadNotVerified(
                "patch.value", f"the approved change set {key!r} to another value"
            )


async def _checkpoint_of_head(
    client: ZtateClient, thread_id: str, version: int, keys: PublicKeys, wait: float
) -> dict[str, Any]:
    """The newest signed checkpoint, verified, once it reaches ``version`` (or the
    last one seen when ``wait`` runs out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    pause = FIRST_POLL_SECONDS
    while True:
        checkpoint = await client.get_checkpoint(thread_id)
        if checkpoint is not None:
            # the signature is checked before anything in it is read
            body = verify_checkpoint(
                SignedCheckpoint(
                    checkpoint.checkpoint_json, checkpoint.signature, checkpoint.key_id
                ),
                keys,
            )
            if body["version"] >= version or loop.time() >= deadline:
                return body
        elif loop.time() >= deadline:
            raise HeadNotVerified("checkpoint.missing", "no checkpoint of this thread is signed")
        # checkpoints are signed on a timer, not announced: poll, backing off
        await asyncio.sleep(min(pause, max(deadline - loop.time(), 0.0)))
        pause = min(pause * 2, LONGEST_POLL_SECONDS)
