"""What a reviewer is shown, derived by the approval service from the bytes it signs for.

A review used to show a summary of changes that the submitter supplied beside the
proposal, and nothing checked one against the other: whoever held the transition
service's certificate could show "target_user_id unchanged" and commit another value
under a genuine receipt. Now the submitter sends the base ledger record and the base
state; this module checks that

1. the base record hashes to the proposal's ``parent_digest`` and is that thread's
   record at ``base_version``;
2. the base state hashes to that record's ``state_digest``;
3. applying the proposal's own patch to the base state gives the proposal's
   ``state_digest``,

and computes the diff itself. The proposal bytes are exactly what the receipt binds
(their SHA-256 is the transition digest), so what is shown is what can commit.

Values of keys the policy marks sensitive are shown as HMAC-SHA256 under a key
derived from the approval service's signing key (HKDF, its own label), which no
reviewer holds: equal values show equal digests, and a low-entropy value (an amount,
an id) cannot be confirmed by hashing guesses, as a plain SHA-256 allowed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.services.policy.changes import apply_patch
from ztate.services.runtime import errors

REDACTION_LABEL = b"ztate/approval/redaction/v1"


def redaction_key(signing_key: Ed25519PrivateKey) -> bytes:
    """The key of the keyed digests reviewers see, derived from the signing key."""
    seed = signing_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=REDACTION_LABEL).derive(seed)


def _object(data: bytes, what: str) -> JsonObject:
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise errors.RequestInvalid(f"{what} is not JSON") from None
    if not isinstance(parsed, dict):
        raise errors.RequestInvalid(f"{what} must be a JSON object")
    return parsed


def derived_diff(
    proposal: JsonObject,
    base_record_json: bytes,
    base_state_json: bytes,
    sensitive: frozenset[str],
    key: bytes,
) -> bytes:
    """The review's diff (canonical JSON), computed from verified bytes; refuses
    (``RequestInvalid``) any base that is not the one the proposal names."""
    if hashlib.sha256(base_record_json).hexdigest() != proposal.get("parent_digest"):
        raise errors.RequestInvalid("base_record_json is not the record the proposal builds on")
    base_record = _object(base_record_json, "base_record_json")
    named = (base_record.get("thread_id"), base_record.get("version"))
    if named != (proposal.get("thread_id"), proposal.get("base_version")):
        raise errors.RequestInvalid("base_record_json is another thread's or version's record")
    if sha256_hex(base_state_json) != base_record.get("state_digest"):
        raise errors.RequestInvalid("base_state_json does not hash to the base record's state")
    old = _object(base_state_json, "base_state_json")
    patch = proposal.get("patch")
    if not isinstance(patch, dict):
        raise errors.RequestInvalid("the proposal holds no patch")
    if sha256_hex(canonical_bytes(apply_patch(old, patch))) != proposal.get("state_digest"):
        raise errors.RequestInvalid("the proposal's patch on its base does not give its state")

    def shown(name: str, value: Any) -> Any:
        if name in sensitive:
            mac = hmac.new(key, canonical_bytes(value), hashlib.sha256).hexdigest()
            return {"redacted_hmac_sha256": mac}
        return value

    changes: JsonObject = {}
    for name, new in sorted(patch.items()):
        change: JsonObject = {}
        if name in old:
            change["old"] = shown(name, old[name])
        if new is not None:
            change["new"] = shown(name, new)
        changes[name] = change
    return canonical_bytes({"changes": changes})
