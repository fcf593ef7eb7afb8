"""The ledger record and its chain: digest, HMAC signature and verification.

``docs/ledger-format.md`` is the normative description; ``tests/vectors`` holds
fixed inputs with their expected digests and signatures. In short::

    record_bytes = JCS(record)                   # RFC 8785
    digest       = sha256(record_bytes)          # 32 bytes, written as lower-case hex
    signature    = HMAC-SHA256(key[key_id], digest bytes)
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from ztate.services.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.services.keyring import Keyring

RECORD_FORMAT = 1
GENESIS_PARENT = "0" * 64
KIND_GENESIS = "genesis"
KIND_TRANSITION = "transition"
KIND_REVERT = "revert"  # an operator's repair: a new transition restoring an earlier state
KINDS_AFTER_GENESIS = frozenset({KIND_TRANSITION, KIND_REVERT})


class ChainError(Exception):
    """A record that does not verify; the message says what was expected and found."""


@dataclass(frozen=True, slots=True)
class SealedRecord:
    """A ledger record in the exact bytes that were hashed, with digest and signature."""

    record: JsonObject
    record_bytes: bytes
    digest: str
    signature: str
    key_id: str


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds and a ``Z``, as records carry it."""
    utc = moment.astimezone(UTC)
    if utc.year < 1000:  # isoformat agrees with strftime only for four-digit years
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def build_record(
    *,
    kind: str,
    thread_id: str,
    version: int,
    parent_digest: str,
    node_id: str,
    patch: JsonObject,
    state_digest: str,
    policy_digest: str,
    receipt_digest: str | None,
    key_id: str,
    committed_at: datetime,
) -> JsonObject:
    """The record of one transition, as docs/ledger-format.md defines it."""
    return {
        "format": RECORD_FORMAT,
        "kind": kind,
        "thread_id": thread_id,
        "version": version,
        "parent_digest": parent_digest,
        "node_id": node_id,
        "patch": patch,
        "state_digest": state_digest,
        "policy_digest": policy_digest,
        "receipt_digest": receipt_digest,
        "key_id": key_id,
        "committed_at": format_time(committed_at),
    }


def sign_digest(key: bytes, digest_hex: str) -> str:
    """HMAC-SHA256 of the 32 digest bytes, lower-case hex."""
    return hmac.digest(key, bytes.fromhex(digest_hex), "sha256").hex()


def seal(record: JsonObject, keyring: Keyring) -> SealedRecord:
    """Canonicalise, hash and sign a record under the keyring's current key."""
    if record["key_id"] != keyring.current:
        raise ValueError("record key_id must be the keyring's current key")
    record_bytes = canonical_bytes(record)
    digest = sha256_hex(record_bytes)
    signature = sign_digest(keyring.key(keyring.current), digest)
    return SealedRecord(record, record_bytes, digest, signature, keyring.current)


RECORD_MEMBERS = frozenset(
    build_record(
        kind=KIND_GENESIS,
        thread_id="",
        version=0,
        parent_digest=GENESIS_PARENT,
        node_id="",
        patch={},
        state_digest="",
        policy_digest="",
        receipt_digest=None,
        key_id="",
        committed_at=datetime.now(UTC),
    )
)
HEX_256 = re.compile(r"^[0-9a-f]{64}\Z")


def verify_record(
    record_bytes: bytes,
    *,
    digest: str,
    signature: str,
    keyring: Keyring,
    expected_parent: str | None = None,
    expected_version: int | None = None,
) -> JsonObject:
    """Check one stored record against its digest, signature and place in the chain.

    Returns the parsed record. Raises ``ChainError`` naming the first mismatch,
    whatever the bytes hold.
    """
    found = sha256_hex(record_bytes)
    if found != digest:
        raise ChainError(f"digest mismatch: stored {digest}, recomputed {found}")
    if not HEX_256.match(signature):
        raise ChainError("signature is not 64 lower-case hex characters")
    record = _parse_record(record_bytes)
    key_id = record["key_id"]
    try:
        key = keyring.key(key_id)
    except KeyError:
        raise ChainError(f"unknown key id {key_id!r}") from None
    if not hmac.compare_digest(sign_digest(key, digest), signature):
        raise ChainError(f"HMAC signature does not verify under key {key_id!r}")
    if expected_parent is not None and record["parent_digest"] != expected_parent:
        raise ChainError(
            f"parent mismatch: expected {expected_parent}, found {record['parent_digest']}"
        )
    if expected_version is not None and record["version"] != expected_version:
        raise ChainError(
            f"version mismatch: expected {expected_version}, found {record['version']}"
        )
    return record


def kind_fits(kind: object, version: int) -> bool:
    """Genesis at version 0 only; a transition or a revert at every later version."""
    return kind == KIND_GENESIS if version == 0 else kind in KINDS_AFTER_GENESIS


def _parse_record(record_bytes: bytes) -> JsonObject:
    """Parse record bytes that must be canonical JSON of a format-1 record."""
    try:
        parsed = json.loads(record_bytes)
    except (ValueError, RecursionError):
        raise ChainError("record bytes are not JSON") from None
    if not isinstance(parsed, dict):
        raise ChainError("record is not a JSON object")
    try:
        canonical = canonical_bytes(parsed)
    except (ValueError, TypeError, RecursionError):
        raise ChainError("record holds values outside the canonical JSON domain") from None
    if canonical != record_bytes:
        raise ChainError("record bytes are not in canonical (RFC 8785) form")
    if parsed.keys() != RECORD_MEMBERS:
        raise ChainError(
            f"record members differ from format {RECORD_FORMAT}: "
            f"missing {sorted(RECORD_MEMBERS - parsed.keys())}, "
            f"unexpected {sorted(parsed.keys() - RECORD_MEMBERS)}"
        )
    if parsed["format"] != RECORD_FORMAT:
        raise ChainError(f"unsupported record format {parsed['format']!r}")
    version = parsed["version"]
    if type(version) is not int or not isinstance(parsed["key_id"], str):
        raise ChainError("record version must be an integer and key_id a string")
    if not kind_fits(parsed["kind"], version):
        raise ChainError(f"record kind {parsed['kind']!r} does not fit version {version}")
    return parsed


@dataclass(frozen=True, slots=True)
class StoredLink:
    """What verification needs of one stored ledger row."""

    version: int
    record_bytes: bytes
    digest: str
    signature: str
    key_id: str | None = None  # the row's key id column, compared to the record's


def verify_chain(links: Iterable[StoredLink], keyring: Keyring, *, thread_id: str) -> int:
    """Verify one thread's records in version order from genesis.

    Checks each digest, signature, parent link and that versions run 0, 1, 2, ...
    with no gap. Returns the number of records. Raises ``ChainError``.
    """
    parent, count = GENESIS_PARENT, 0
    for expected_version, link in enumerate(links):
        if link.version != expected_version:
            raise ChainError(
                f"thread {thread_id}: expected version {expected_version}, found {link.version}"
            )
        try:
            record = verify_record(
                link.record_bytes,
                digest=link.digest,
                signature=link.signature,
                keyring=keyring,
                expected_parent=parent,
                expected_version=expected_version,
            )
        except ChainError as exc:
            raise ChainError(f"thread {thread_id} version {expected_version}: {exc}") from None
        if record["thread_id"] != thread_id:
            raise ChainError(f"thread {thread_id} version {expected_version}: foreign thread id")
        if link.key_id is not None and link.key_id != record["key_id"]:
            raise ChainError(
                f"thread {thread_id} version {expected_version}: stored key id "
                f"{link.key_id!r} differs from the record's {record['key_id']!r}"
            )
        parent, count = link.digest, count + 1
    return count


KIND_PROPOSAL = "proposal"


def build_proposal(
    *,
    thread_id: str,
    base_version: int,
    parent_digest: str,
    node_id: str,
    patch: JsonObject,
    state_digest: str,
    policy_digest: str,
    risk_rules: Iterable[str],
) -> JsonObject:
    """What a reviewer approves: one patch by one node on one exact head.

    Its digest (sha256 of its RFC 8785 bytes) is the transition digest an approval
    binds to; docs/policy.md defines it.
    """
    return {
        "format": RECORD_FORMAT,
        "kind": KIND_PROPOSAL,
        "thread_id": thread_id,
        "base_version": base_version,
        "parent_digest": parent_digest,
        "node_id": node_id,
        "patch": patch,
        "state_digest": state_digest,
        "policy_digest": policy_digest,
        "risk_rules": sorted(risk_rules),
    }
