"""The ledger record and its chain: digest, HMAC signature, form, and the transition digest.

``docs/ledger-format.md`` is the normative description; ``tests/vectors`` holds
fixed inputs with their expected digests and signatures, and
``tests/vectors/records/`` one file per way a record can be wrong. In short::

    record_bytes = JCS(record)                   # RFC 8785
    digest       = sha256(record_bytes)          # 32 bytes, written as lower-case hex
    signature    = HMAC-SHA256(key[key_id], digest bytes)
"""

from __future__ import annotations

import hmac
import json
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from ztate.contract.canonical import JsonObject, canonical_bytes, canonical_or_error, sha256_hex
from ztate.contract.errors import RecordInvalid
from ztate.contract.keyring import Keyring

# the format ztate writes: 2 carries the matched risk rule names ("risk_rules"), so
# that a receipt's binding is checked offline with no CEL evaluator; verifiers read
# format 1 (no risk_rules) alongside it
RECORD_FORMAT = 2
RECORD_FORMATS = (1, 2)
# what a reviewer approves keeps format 1: the transition digest is unchanged
PROPOSAL_FORMAT = 1
GENESIS_PARENT = "0" * 64
KIND_GENESIS = "genesis"
KIND_TRANSITION = "transition"
KIND_REVERT = "revert"  # an operator's repair: a new transition restoring an earlier state
KIND_PROPOSAL = "proposal"  # what a reviewer approves (never stored as a record)
KINDS_AFTER_GENESIS = frozenset({KIND_TRANSITION, KIND_REVERT})

HEX_256 = re.compile(r"^[0-9a-f]{64}\Z")
# exactly as format_time writes it: RFC 3339, UTC, six fraction digits, a Z
TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z\Z")
SHOWN_MAX = 160

# the members of a format-1 record and their JSON types (receipt_digest may be null)
MEMBER_TYPES: dict[str, tuple[type, ...]] = {
    "format": (int,),
    "kind": (str,),
    "thread_id": (str,),
    "version": (int,),
    "parent_digest": (str,),
    "node_id": (str,),
    "patch": (dict,),
    "state_digest": (str,),
    "policy_digest": (str,),
    "receipt_digest": (str, type(None)),
    "key_id": (str,),
    "committed_at": (str,),
}
RECORD_MEMBERS = frozenset(MEMBER_TYPES)
# format 2: the same members and the matched risk rule names, a sorted list of
# distinct strings (the order of the transition digest's risk_rules)
RECORD_MEMBERS_2 = RECORD_MEMBERS | {"risk_rules"}
MEMBERS_OF_FORMAT = {1: RECORD_MEMBERS, 2: RECORD_MEMBERS_2}
_TYPED_MEMBERS = operator.itemgetter(*MEMBER_TYPES)
# the member types of a well-typed record, with and without a receipt digest: one
# comparison instead of twelve on the verifier's path
_WELL_TYPED = frozenset(
    tuple(types[0] if name != "receipt_digest" else receipt for name, types in MEMBER_TYPES.items())
    for receipt in (str, type(None))
)


@dataclass(frozen=True, slots=True)
class SealedRecord:
    """A ledger record in the exact bytes that were hashed, with digest and signature."""

    record: JsonObject
    record_bytes: bytes
    digest: str
    signature: str
    key_id: str


def shown(value: object) -> str:
    """A value from verified data as an error may show it: escaped and bounded."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= SHOWN_MAX else text[:SHOWN_MAX] + "..."


def printable(value: object) -> str:
    """``value`` as text for a terminal line, whole: every character Python does not
    call printable (controls such as ESC, format characters such as a right-to-left
    override, line and paragraph separators) written as its escape, the rest as it is
    (``shown`` escapes all but ASCII and bounds the length: for a value inside a
    message). A None reads None."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds and a ``Z``, as records, receipts and
    checkpoints carry it."""
    utc = moment.astimezone(UTC)
    if utc.year < 1000:  # isoformat agrees with strftime only for four-digit years
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def parse_time(text: object) -> datetime | None:
    """A time exactly as ``format_time`` writes it, or None (another form, or no such
    date): ``2026-01-02T03:04:05.000006Z``, never an offset or fewer digits."""
    if not isinstance(text, str) or not TIME.match(text):
        return None
    try:
        return datetime.fromisoformat(text[:-1] + "+00:00")
    except ValueError:
        return None


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
    risk_rules: Iterable[str] | None = None,
) -> JsonObject:
    """The record of one transition, as docs/ledger-format.md defines it: format 2
    with the names of the risk rules the transition matched (sorted; empty for a
    genesis, a revert and a transition that matched none), or format 1 when
    ``risk_rules`` is None (what ztate wrote before; kept for vectors and tests)."""
    record: JsonObject = {
        "format": 1 if risk_rules is None else RECORD_FORMAT,
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
    if risk_rules is not None:
        record["risk_rules"] = sorted(set(risk_rules))
    return record


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


def kind_fits(kind: object, version: int) -> bool:
    """Genesis at version 0 only; a transition or a revert at every later version."""
    return kind == KIND_GENESIS if version == 0 else kind in KINDS_AFTER_GENESIS


def record_problems(record: JsonObject) -> list[str]:
    """What keeps a parsed object from being a format-1 or format-2 record: its
    format, its members, their types, its kind at its version, its digests' and
    time's shapes, its risk rule names (docs/ledger-format.md, "Checks"). Empty when
    it is one. The format decides the members: format 1 without ``risk_rules``,
    format 2 with it; a format that is not the integer 1 or 2 is the only problem."""
    _integers_by_value(record)
    form = record.get("format")
    if type(form) is not int or form not in MEMBERS_OF_FORMAT:
        return [f"format {shown(form)} (1 or 2, an integer)"]
    members = MEMBERS_OF_FORMAT[form]
    if record.keys() != members:
        return [
            f"missing members {sorted(members - record.keys())}, "
            f"unexpected {[shown(k) for k in sorted(record.keys() - members)]}"
        ]
    if tuple(map(type, _TYPED_MEMBERS(record))) not in _WELL_TYPED:
        return [
            f"{name} is a {type(record[name]).__name__}"
            for name, types in MEMBER_TYPES.items()
            if type(record[name]) not in types
        ]
    problems: list[str] = []
    if form == 2:
        problems += risk_rules_problems(record["risk_rules"])
    version = record["version"]
    if version < 0:
        problems.append(f"version {version} is negative")
    elif not kind_fits(record["kind"], version):
        problems.append(f"kind {shown(record['kind'])} at version {version}")
    for name in ("parent_digest", "state_digest"):
        if not HEX_256.match(record[name]):
            problems.append(f"{name} is not 64 lower-case hex characters")
    receipt_digest = record["receipt_digest"]
    if receipt_digest is not None and not HEX_256.match(receipt_digest):
        problems.append("receipt_digest is not 64 lower-case hex characters")
    if parse_time(record["committed_at"]) is None:
        problems.append(f"committed_at {shown(record['committed_at'])} is not RFC 3339 UTC")
    return problems


def _integers_by_value(record: JsonObject) -> None:
    """``format`` and ``version`` are compared by value, as a reader that parses every
    number as a double sees them: ``1.0`` is the integer 1 here. How the number is
    spelled is the canonical check's concern (RFC 8785 writes 1.0 as ``1``, so
    non-canonical bytes spelled ``1.0`` fail that check, never this one)."""
    for name in ("format", "version"):
        value = record.get(name)
        if type(value) is float and value.is_integer():
            record[name] = int(value)


def risk_rules_problems(rules: object) -> list[str]:
    """Why a format-2 record's ``risk_rules`` is not a list of distinct strings in
    ascending code point order (empty when it is)."""
    if type(rules) is not list or any(type(rule) is not str for rule in rules):
        return ["risk_rules is not a list of strings"]
    if rules != sorted(set(rules)):
        return ["risk_rules is not sorted by name without repeats"]
    return []


def record_risk_rules(record: JsonObject) -> list[str] | None:
    """The risk rules a well-formed record says its transition matched (format 2),
    or None when it does not say (format 1)."""
    rules = record.get("risk_rules")
    return list(rules) if record["format"] >= 2 and isinstance(rules, list) else None


def _canonical_record(parsed: JsonObject) -> bytes:
    try:
        return canonical_bytes(parsed)
    except (ValueError, TypeError, RecursionError):
        raise RecordInvalid(
            "record holds values outside the canonical JSON domain", check="record.form"
        ) from None


def parse_record(record_bytes: bytes) -> JsonObject:
    """Record bytes that must be canonical JSON of a format-1 or format-2 record, parsed.

    Raises ``RecordInvalid`` with check ``record.form``: not JSON of an object in its
    own RFC 8785 form, or one of ``record_problems``.
    """
    try:
        parsed = json.loads(record_bytes)
    except (ValueError, RecursionError):
        raise RecordInvalid("record bytes are not JSON", check="record.form") from None
    if not isinstance(parsed, dict):
        raise RecordInvalid("record is not a JSON object", check="record.form")
    if _canonical_record(parsed) != record_bytes:
        raise RecordInvalid(
            "record bytes are not in canonical (RFC 8785) form", check="record.form"
        )
    problems = record_problems(parsed)
    if problems:
        raise RecordInvalid("; ".join(problems), check="record.form")
    return parsed


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

    Returns the parsed record. Raises ``RecordInvalid`` naming the first failed check
    (``record.digest``, ``record.form``, ``record.key_id``,
    ``record.signature``, ``record.parent``, ``record.version``), whatever the bytes
    hold. ``ztate verify`` reports every failure of a whole ledger instead.
    """
    found = sha256_hex(record_bytes)
    if found != digest:
        raise RecordInvalid(
            f"digest mismatch: stored {shown(digest)}, recomputed {found}", check="record.digest"
        )
    if not HEX_256.match(signature):
        raise RecordInvalid(
            "signature is not 64 lower-case hex characters", check="record.signature"
        )
    record = parse_record(record_bytes)
    key_id = record["key_id"]
    try:
        key = keyring.key(key_id)
    except KeyError:
        raise RecordInvalid(f"unknown key id {key_id!r}", check="record.key_id") from None
    if not hmac.compare_digest(sign_digest(key, digest), signature):
        raise RecordInvalid(
            f"HMAC signature does not verify under key {key_id!r}", check="record.signature"
        )
    if expected_parent is not None and record["parent_digest"] != expected_parent:
        raise RecordInvalid(
            f"parent mismatch: expected {expected_parent}, found {record['parent_digest']}",
            check="record.parent",
        )
    if expected_version is not None and record["version"] != expected_version:
        raise RecordInvalid(
            f"version mismatch: expected {expected_version}, found {record['version']}",
            check="record.version",
        )
    return record


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
    binds to; docs/policy.md defines it. ``risk_rules`` are sorted by name.
    """
    return {
        "format": PROPOSAL_FORMAT,
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


def transition_digest(record: JsonObject, risk_rules: Iterable[str] | None = None) -> str:
    """The transition digest a reviewer approved, rebuilt from the committed record
    and the risk rules its proposal matched (docs/policy.md, "the transition digest").

    A format-2 record carries its risk rules, and they are used when ``risk_rules``
    is None; a format-1 record needs them given (re-derived from the policy)."""
    if risk_rules is None:
        risk_rules = record_risk_rules(record)
        if risk_rules is None:
            raise ValueError("a format 1 record carries no risk rules: pass them")
    proposal = build_proposal(
        thread_id=record["thread_id"],
        base_version=record["version"] - 1,
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        patch=record["patch"],
        state_digest=record["state_digest"],
        policy_digest=record["policy_digest"],
        risk_rules=risk_rules,
    )
    return sha256_hex(canonical_or_error(proposal, RecordInvalid, "record.form"))
