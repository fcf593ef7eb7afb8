"""Refusing to act on a head that was not approved: the privileged worker's check."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from worker_sdk._evidence import (
    EvidenceError,
    PublicKeys,
    check_receipt_binds,
    sha256_hex,
    verify_checkpoint,
    verify_receipt,
)
from worker_sdk.client import Checkpoint, ZtateClient


class HeadNotVerified(Exception):
    """The head may not be acted on: ``check`` names what failed (``head.moved``,
    ``record.digest``, ``receipt.missing``, ``receipt.signature``, ``receipt.form``,
    ``receipt.digest``, ``receipt.binding``, ``receipt.expired``,
    ``checkpoint.missing``, ``checkpoint.signature``, ``checkpoint.form``,
    ``checkpoint.head``), ``message`` says how."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message


@dataclass(frozen=True, slots=True)
class VerifiedHead:
    """A head whose approval and checkpoint verified with public keys.

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
    approval_keys: PublicKeys,
    checkpoint_keys: PublicKeys,
    expected_version: int | None = None,
    checkpoint_wait: float = 10.0,
) -> VerifiedHead:
    """Fetch the head of ``thread_id`` now and prove, with public keys only, that it
    was approved; raise ``HeadNotVerified`` otherwise.

    Checked: the record hashes to its digest and is the thread's head (at
    ``expected_version``, when given: the version the worker decided on); it
    names an approval receipt, which is the one stored with it; the receipt's
    Ed25519 signature under ``approval_keys``, its canonical form, and its binding
    to this record (thread, base version, the transition digest rebuilt from the
    record and its matched risk rules, an approval, valid when committed); and a
    checkpoint of this very head signed under ``checkpoint_keys``. Checkpoints are
    signed periodically, so this waits up to ``checkpoint_wait`` seconds for one
    that covers the head.
    """
    found = await client.get_record(thread_id)
    transition = found.transition
    if expected_version is not None and transition.version != expected_version:
        raise HeadNotVerified(
            "head.moved", f"the head is at {transition.version}, not {expected_version}"
        )
    if sha256_hex(transition.record_json) != transition.digest:
        raise HeadNotVerified("record.digest", "the record does not hash to its digest")
    record = json.loads(transition.record_json)
    if (record.get("thread_id"), record.get("version")) != (thread_id, transition.version):
        raise HeadNotVerified("record.digest", "the record is not this thread's head")
    if record.get("receipt_digest") is None or found.receipt is None:
        raise HeadNotVerified("receipt.missing", "the head was committed without an approval")
    try:
        receipt = verify_receipt(
            found.receipt.receipt_json, found.receipt.signature, found.receipt.key_id, approval_keys
        )
        check_receipt_binds(receipt, found.receipt.receipt_json, record, list(found.risk_rules))
        checkpoint = await _checkpoint_of_head(
            client, thread_id, transition.version, checkpoint_wait
        )
        body = verify_checkpoint(
            checkpoint.checkpoint_json, checkpoint.signature, checkpoint.key_id, checkpoint_keys
        )
    except EvidenceError as failed:
        raise HeadNotVerified(failed.check, failed.message) from None
    if (body["thread_id"], body["version"], body["head_digest"]) != (
        thread_id,
        transition.version,
        transition.digest,
    ):
        raise HeadNotVerified("checkpoint.head", "the signed checkpoint names another head")
    return VerifiedHead(thread_id, transition.version, transition.digest, record, receipt, body)


async def _checkpoint_of_head(
    client: ZtateClient, thread_id: str, version: int, wait: float
) -> Checkpoint:
    """The newest checkpoint, once it reaches ``version`` (or the last one seen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        checkpoint = await client.get_checkpoint(thread_id)
        if checkpoint is not None:
            signed = json.loads(checkpoint.checkpoint_json).get("version")
            if signed == version or loop.time() >= deadline:
                return checkpoint
        elif loop.time() >= deadline:
            raise EvidenceError("checkpoint.missing", "no checkpoint of this thread is signed")
        await asyncio.sleep(0.1)  # checkpoints are signed on a timer, not announced
