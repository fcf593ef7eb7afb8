"""What the benchmark writes, under the default policy (``services/defaults/policy.yaml``).

A patch may only hold keys its node may write, and every value must fit the type
the policy declares for its key. The one writable key there that admits ~1 KB
is the approval gate's ``approval_receipt`` (an opaque string of up to 4 KB), so
the workload is the approval gate recording receipts: ``{"approval_receipt":
"<token>"}``, the token being printable base64url text of the size asked for,
as a signed receipt's encoding is. (``input-parser``'s ``requested_action`` is an
object of three short fields, and that node's patches are capped at 4 KB.)
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import ztate.services
from ztate.worker_sdk import encode_json

DEFAULT_POLICY = Path(ztate.services.__file__).resolve().parent / "defaults" / "policy.yaml"

TRUST_DOMAIN = "ztate.bench"
WRITER_NODE = "approval-gate"
WRITTEN_KEY = "approval_receipt"
OPERATOR_NAME = "bench"
# the columns of ztate.transitions a benchmark ledger is loaded with (COPY)
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

INITIAL_STATE: dict[str, Any] = {
    "raw_text": "refund order 42 and send the receipt to my usual address",
    "authority": {"tenant": "support-desk", "acting_for": "customer u-1042"},
    "target_user_id": "6f1c2a9e-3b7d-4c8e-9a51-0d2f4b6e8a13",
}


def receipt_patch(target_bytes: int) -> dict[str, Any]:
    """``{"approval_receipt": token}`` whose wire JSON is ``target_bytes`` long."""
    overhead = len(encode_json({WRITTEN_KEY: ""}))
    return {WRITTEN_KEY: _token(max(1, target_bytes - overhead))}


def _token(length: int) -> str:
    """Deterministic base64url text, as a signed receipt's encoding looks."""
    text, block = "", b"ztate-bench-receipt"
    while len(text) < length:
        block = hashlib.sha256(block).digest()
        text += base64.urlsafe_b64encode(block).decode("ascii").rstrip("=")
    return text[:length]
