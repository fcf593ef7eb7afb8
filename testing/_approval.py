"""Approvals in tests: what the approval service would deliver, a genuine receipt."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from ztate.contract.keyring import load_signing_key
from ztate.contract.receipts import build_receipt, sign_receipt
from ztate.services.runtime.identity import Role
from ztate.testing._pki import TRUST_DOMAIN, Pki, secure_channel
from ztate.v1 import approval_pb2, transition_pb2, transition_pb2_grpc


async def deliver_approval(
    target: str, pki: Pki, signing_key: Path, digest: str, thread_id: str, base_version: int
) -> transition_pb2.ApplyDecisionResponse:
    """ApplyDecision as the approval service would call it, with a genuine receipt signed
    by ``signing_key`` (key id ``approval-k1``) approving ``digest``."""
    now = datetime.now(UTC)
    receipt = sign_receipt(
        build_receipt(
            transition_digest=digest,
            thread_id=thread_id,
            base_version=base_version,
            decision="approve",
            reviewers=[f"spiffe://{TRUST_DOMAIN}/reviewer/alice"],
            issued_at=now - timedelta(seconds=1),
            expires_at=now + timedelta(minutes=5),
            key_id="approval-k1",
        ),
        load_signing_key(signing_key),
    )
    async with secure_channel(target, pki.identity(Role.SERVICE, "approval")) as opened:
        applied: transition_pb2.ApplyDecisionResponse = await (
            transition_pb2_grpc.TransitionServiceStub(opened).ApplyDecision(
                transition_pb2.ApplyDecisionRequest(
                    receipt=approval_pb2.SignedReceipt(
                        receipt_json=receipt.receipt_bytes,
                        signature=receipt.signature,
                        key_id=receipt.key_id,
                    )
                )
            )
        )
    return applied
