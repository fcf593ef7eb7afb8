"""The offline verifier: check a stored ledger without trusting the service that wrote it.

A security team runs this against a copy of the database or an exported bundle
(``ztate.services.verify.bundle``) with nothing but key material and the policies: the HMAC
keyring, the approval service's Ed25519 public keys and the policy files. The
transition service need not run, and nothing the database says about itself is
taken on trust: every record is re-hashed from its stored bytes, every unsigned
column is compared with the signed record, every state is replayed from the
patches, and every risk rule is re-derived to see that a receipt authorised the
transitions that needed one. ``docs/ledger-format.md`` section 7 is the algorithm.

Two properties shape the code:

* **Streaming.** Rows arrive in ``(thread_id, version)`` order and a
  ``ThreadVerifier`` keeps only what the next record needs (the previous digest
  and state, and the state digests of the thread's earlier versions, which a
  revert may restore), so memory grows with the longest thread, not the ledger.
* **Every failure, precisely.** A check never raises: it reports a ``Finding``
  (thread, version, check, expected, found) and verification goes on, to the
  next record and the next thread. After a gap or a misplaced record the chain
  re-synchronises on the next record whose stored state verifies, so one
  tampered row is reported once instead of cascading down the thread. Findings
  show digests and identities, never the content of state values.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import asyncpg
import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from opentelemetry import metrics

from ztate.contract.canonical import JsonObject, canonical_bytes, orjson_canonical, sha256_hex
from ztate.contract.checkpoints import SignedCheckpoint, verify_checkpoint
from ztate.contract.errors import CheckpointInvalid, ReceiptExpired, ReceiptInvalid
from ztate.contract.keyring import Keyring
from ztate.contract.receipts import APPROVE, SignedReceipt, verify_receipt
from ztate.contract.record import (
    GENESIS_PARENT,
    HEX_256,
    KIND_GENESIS,
    KIND_REVERT,
    KIND_TRANSITION,
    format_time,
    printable,
    record_problems,
    record_risk_rules,
    shown,
    sign_digest,
    transition_digest,
)

# The risk semantics must be exactly the transition service's, so they are reused
# rather than re-implemented: a verifier that disagreed would cry wolf or miss.
from ztate.services.policy.changes import Change, apply_patch, matched_risk_rules
from ztate.services.policy.model import Policy, PolicyError, PolicySet
from ztate.services.policy.rules import Reads, bind, merge_reads
from ztate.services.store.policies import StoredPolicy, stored_policy_versions

try:  # the compiled lane, built from _chain.c where a compiler and OpenSSL's headers were
    from ztate.services.verify import _chain as LANE
except ImportError:  # pragma: no cover - a build without it: the reference alone
    LANE = None  # type: ignore[assignment]

EXIT_VERIFIED, EXIT_FAILURES, EXIT_CANNOT_RUN = 0, 1, 2

# The checks, as findings name them: the one table (docs/verification.md, "Check
# names", lists exactly these, in this order; tests/unit/test_verify_checks.py compares).
DIGEST = "digest"
CANONICAL = "canonical"
FORMAT = "format"
KEY_ID = "key_id"
SIGNATURE = "signature"
THREAD = "thread_id"
VERSION = "version"
COLUMN = "column"  # a prefix: column.<name>
ROLE = "role"
POLICY = "policy"
STATE = "state"
PARENT = "parent"
REPLAY = "replay"
REVERT = "revert"
RISK_UNCHECKED = "risk.unchecked"
RISK_RULES = "risk.rules"
RISK = "risk"
RECEIPT_UNBOUND = "receipt.unbound"
RECEIPT_MISSING = "receipt.missing"
RECEIPT_DIGEST = "receipt.digest"
RECEIPT_SIGNATURE = "receipt.signature"
RECEIPT_FORM = "receipt.form"
RECEIPT_EXPIRED = "receipt.expired"
RECEIPT_BINDING = "receipt.binding"
CHECKPOINT = "checkpoint"
HEAD = "head"
HEAD_STATE = "head.state"
POLICY_BODY = "policy.body"
BUNDLE_HASH = "bundle.file_hash"
BUNDLE_COUNT = "bundle.count"
BUNDLE_LINE = "bundle.line"
BUNDLE_ORDER = "bundle.order"
BUNDLE_CHECKPOINT = "bundle.checkpoint"
BUNDLE_MANIFEST = "bundle.manifest"

# check -> what fails it (one line each; docs/verification.md says when each runs and
# which version it names)
CHECKS: dict[str, str] = {
    DIGEST: "sha256 of the record bytes is not the stored digest",
    CANONICAL: "the record bytes are not JSON of an object, or not their own RFC 8785 form",
    FORMAT: "format, members, member types, kind at its version, digest/time/rule shapes",
    KEY_ID: "the keyring holds no key with the record's key_id",
    SIGNATURE: "the HMAC of the digest does not verify under the record's key",
    THREAD: "the record names another thread than the one it is stored under",
    VERSION: "a missing, repeated or misplaced version",
    f"{COLUMN}.<name>": "an unsigned column (parent_digest, node_id, key_id, committed_at) "
    "disagrees with the record",
    ROLE: "the identity's role does not fit the record's kind",
    POLICY: "the policy digest names no known policy version, or another policy's",
    STATE: "a kept state body is not canonical or does not hash to state_digest",
    PARENT: "parent_digest is not the previous record's digest (64 zeros at genesis)",
    REPLAY: "the state replayed from the patches does not hash to state_digest",
    REVERT: "a revert's state is no earlier version's state",
    RISK_UNCHECKED: "the policy's risk rules could not be evaluated on the replayed states",
    RISK_RULES: "a format-2 record's risk_rules are not what its policy's rules match",
    RISK: "a transition matching risk rules carries no receipt",
    RECEIPT_UNBOUND: "a receipt is stored but the record's receipt_digest is null",
    RECEIPT_MISSING: "the record names a receipt that is not stored",
    RECEIPT_DIGEST: "sha256 of the stored receipt is not the record's receipt_digest",
    RECEIPT_SIGNATURE: "unknown approval key id, or the Ed25519 signature does not verify",
    RECEIPT_FORM: "the receipt is not a canonical format-1 receipt",
    RECEIPT_EXPIRED: "the receipt was not valid at the record's committed_at",
    RECEIPT_BINDING: "the receipt binds another thread, base version, decision or transition",
    CHECKPOINT: "a signed head does not verify, or the chain does not pass through it",
    HEAD: "the thread's head is not its last record (or is missing)",
    HEAD_STATE: "the head state does not hash to the last record's state_digest",
    POLICY_BODY: "a stored policy version is not the policy its digest names",
    BUNDLE_HASH: "a bundle file's SHA-256 is not the manifest's",
    BUNDLE_COUNT: "a bundle file's line or thread count is not the manifest's",
    BUNDLE_LINE: "a line of a bundle file that is not what the file holds",
    BUNDLE_ORDER: "a thread's lines are not together or not in thread id order, "
    "or checkpoints out of order",
    BUNDLE_CHECKPOINT: "a checkpoint line that is not one",
    BUNDLE_MANIFEST: "the manifest is not the one its signature covers",
}


# The role of the identity (``spiffe://<trust domain>/<role>/<name>``) each kind of
# record needs (docs/ledger-format.md, section 1).
ROLES_OF_KIND: dict[str, tuple[str, ...]] = {
    KIND_GENESIS: ("operator", "service"),
    KIND_TRANSITION: ("node",),
    KIND_REVERT: ("operator",),
}
_SPIFFE = re.compile(r"^spiffe://[^/]+/([^/]+)/[^/]+\Z")


def role_of(node_id: str) -> str | None:
    """The role segment of a SPIFFE ID ``spiffe://<trust domain>/<role>/<name>``."""
    match = _SPIFFE.match(node_id)
    return match.group(1) if match else None


# Through the process's meter provider: exported when telemetry is on (``ztate verify``
# installs it from the settings), a no-op otherwise.
FAILURES = metrics.get_meter("ztate.verify").create_counter(
    "ztate.verify.failures",
    unit="{failure}",
    description="failed verification checks, by check",
)


def counted(report: Report) -> Report:
    """``report``, counting each finding into ``ztate.verify.failures`` first.

    The command counts where every finding ends up, the process that prints it:
    forked workers hand their findings over and count nothing (their copy of the
    meter provider is never exported).
    """

    def count_and_report(finding: Finding) -> None:
        FAILURES.add(1, {"ztate.check": finding.check})
        report(finding)

    return count_and_report


class VerifyError(Exception):
    """Verification could not run at all (exit code 2): no database, no ledger."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One failed check: where (thread, version), which check, expected and found."""

    thread_id: str | None
    version: int | None
    check: str
    expected: str
    found: str

    def as_json(self) -> dict[str, Any]:
        return {
            "thread_id": self.thread_id,
            "version": self.version,
            "check": self.check,
            "expected": self.expected,
            "found": self.found,
        }

    def __str__(self) -> str:
        """The finding as a line of text for a terminal: what the source chose (a thread
        id, a value in expected or found) shown with its control and format characters
        escaped, so that no ledger can move the cursor or write a line of its own."""
        if self.thread_id is not None:
            where = f"thread {printable(self.thread_id)}"
        else:
            where = "bundle" if self.check.startswith("bundle.") else "ledger"
        if self.version is not None:
            where += f" version {self.version}"
        expected, found = printable(self.expected), printable(self.found)
        return f"{where}: {self.check}: expected {expected}; found {found}"


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """One stored transition as the verifier receives it, from Postgres or a bundle.

    Only ``record`` is signed; every other field is an unsigned copy or companion.
    """

    thread_id: str
    version: int
    digest: str
    parent_digest: str
    node_id: str
    key_id: str
    signature: str
    record: bytes
    state: bytes | None
    receipt: bytes | None
    receipt_signature: str | None
    receipt_key_id: str | None
    committed_at: str | None  # RFC 3339 as records write it; None if the source has none


@dataclass(frozen=True, slots=True)
class Head:
    """What the source claims is a thread's head; ``state`` None when it keeps none."""

    version: int | None  # None: a null column (a database whose constraint was dropped)
    digest: str
    state: bytes | None


@dataclass(frozen=True, eq=False)
class Trust:
    """Everything the verifier trusts: key material and the known policies."""

    keyring: Keyring | None  # None: public-only, no HMAC check
    approval_keys: Mapping[str, Ed25519PublicKey]
    # the policy versions given (``--policy``): a folder may hold several versions
    # of one policy, indexed by digest
    policies: PolicySet | Sequence[Policy]
    # the transition service's checkpoint public keys; None: checkpoints not checked
    checkpoint_keys: Mapping[str, Ed25519PublicKey] | None = None
    # checkpoints kept outside the verified source (the signer's journal, a witness's
    # copy: ``ztate verify --checkpoints``), by thread and version; the chain must pass
    # through each, whatever the source holds or lost
    kept_checkpoints: Mapping[str, Mapping[int, SignedCheckpoint]] = field(default_factory=dict)
    # a bundle without a signed manifest (manifest.sig) is a finding
    require_signed_manifest: bool = False
    # every record checked by the reference (this module) alone, none by the compiled
    # lane (``ztate verify --reference-only``): the same verdict and findings, slower
    reference_only: bool = False
    # the versions the verified source keeps (``ztate.policies``, a bundle's
    # policies.jsonl) whose body hashes to their digest (``with_versions``)
    stored: tuple[Policy, ...] = ()
    # every version known, given or stored, by digest (a given one wins)
    by_digest: dict[str, Policy] = field(init=False)
    # what each policy's risk expressions read (by policy digest): only these are
    # bound to re-derive the risk rules, not what its invariants read
    risk_reads: dict[str, Reads] = field(init=False)
    # what decides each policy's risk rules: the above and the keys of its key rules
    risk_inputs: dict[str, Reads] = field(init=False)

    def __post_init__(self) -> None:
        by_digest = {policy.digest: policy for policy in self.stored}
        by_digest.update((policy.digest, policy) for policy in self.given_policies)
        object.__setattr__(self, "by_digest", by_digest)
        risk_reads = {
            digest: merge_reads(
                [rule.expression for rule in policy.risk_rules if rule.expression is not None]
            )
            for digest, policy in by_digest.items()
        }
        object.__setattr__(self, "risk_reads", risk_reads)
        risk_inputs = {
            digest: _with_keys(risk_reads[digest], policy) for digest, policy in by_digest.items()
        }
        object.__setattr__(self, "risk_inputs", risk_inputs)

    @property
    def given_policies(self) -> list[Policy]:
        """The policy versions given to the verifier."""
        if isinstance(self.policies, PolicySet):
            return list(self.policies.policies.values())
        return list(self.policies)

    def with_versions(self, versions: Iterable[Policy]) -> Trust:
        """This trust, knowing the stored ``versions`` too (a digest already known
        keeps its policy)."""
        added = tuple(p for p in versions if p.digest not in self.by_digest)
        return self if not added else replace(self, stored=self.stored + added)


# a stored policy body longer than this is a finding, never parsed (policy files are
# kilobytes; whoever controls the store must not make the verifier compile megabytes)
MAX_POLICY_BODY = 1024 * 1024


def admit_policy_versions(trust: Trust, stored: Iterable[StoredPolicy], report: Report) -> Trust:
    """``trust`` knowing each stored policy version whose body is the policy its
    digest names: the digest is signed inside every record that names it, so a body
    that hashes to it is that policy, whoever stored it. Any other stored version is
    reported (check ``policy.body``, no thread, no version) and not used."""
    admitted: list[Policy] = []
    for version in stored:
        expected = f"a policy body hashing to its digest {shown(version.digest)}"
        size = version.size if version.size is not None else len(version.body)
        if size > MAX_POLICY_BODY:
            found = f"a body of {size} bytes (more than {MAX_POLICY_BODY}: not read)"
            report(Finding(None, None, POLICY_BODY, expected, found))
            continue
        found = sha256_hex(version.body)
        if found != version.digest:
            report(Finding(None, None, POLICY_BODY, expected, f"a body hashing to {found}"))
            continue
        try:
            policy = Policy.from_body(version.body, source=f"policy {version.digest[:16]}")
        except PolicyError as exc:
            found = f"no valid policy: {shown(str(exc))}"
            report(Finding(None, None, POLICY_BODY, expected, found))
            continue
        if policy.name != version.name:
            found = f"a body of policy {shown(policy.name)} stored as {shown(version.name)}"
            report(Finding(None, None, POLICY_BODY, expected, found))
            continue
        admitted.append(policy)
    return trust.with_versions(admitted)


def _with_keys(reads: Reads, policy: Policy) -> Reads:
    """``reads`` and the keys the policy's key rules compare in ``patch`` and ``old``."""
    keys = frozenset(key for rule in policy.risk_rules for key in rule.keys)
    merged = dict(reads)
    for var in ("patch", "old"):
        if keys and var not in merged:
            merged[var] = keys
        elif keys and merged[var] is not None:
            merged[var] = (merged[var] or frozenset()) | keys
    return merged


@dataclass
class Summary:
    threads: int = 0
    records: int = 0
    failures: int = 0

    @property
    def exit_code(self) -> int:
        return EXIT_VERIFIED if self.failures == 0 else EXIT_FAILURES

    def as_json(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "records": self.records,
            "failures": self.failures,
            "verified": self.failures == 0,
        }


Report = Callable[[Finding], None]
Matched = Sequence[str]  # the names of the risk rules a transition matches


class Verification:
    """One run: counts records, threads and failures, and passes findings on."""

    def __init__(self, trust: Trust, report: Report) -> None:
        self.trust = trust
        self.summary = Summary()
        self._report = report
        # the risk rules matched, by policy digest and the exact JSON of everything
        # they read (a pure function of it): most transitions repeat a few inputs.
        # Tuples: a hit hands out the entry itself, which nobody can change
        self.risk_memo: dict[tuple[str, bytes], tuple[str, ...]] = {}
        # the threads of the kept checkpoints the source held records of
        self._kept_seen: set[str] = set()
        self._lane: tuple[Trust, Any] | None = None

    def finding(self, finding: Finding) -> None:
        self.summary.failures += 1
        self._report(finding)

    @property
    def lane(self) -> Any:
        """The compiled lane (``_chain.c``), which takes the rows it confirms whole, for
        the run's trust as it stands (the source's stored policy versions admitted)."""
        if self._lane is None or self._lane[0] is not self.trust:
            self._lane = (self.trust, compiled_lane(self.trust))
        return self._lane[1]

    def thread(self, thread_id: str) -> ThreadVerifier:
        self.summary.threads += 1
        if thread_id in self.trust.kept_checkpoints:
            self._kept_seen.add(thread_id)
        return ThreadVerifier(thread_id, self)

    @property
    def kept_seen(self) -> frozenset[str]:
        """The threads of kept checkpoints whose records this run saw."""
        return frozenset(self._kept_seen)

    def saw(self, thread_id: str) -> None:
        """A thread with records, verified elsewhere (a worker of ``--jobs``)."""
        if thread_id in self.trust.kept_checkpoints:
            self._kept_seen.add(thread_id)

    def kept_threads_missing(self, thread_id: str | None) -> None:
        """Report every kept checkpoint of a thread the source held no record of (its
        records were removed, or the whole thread was), among ``thread_id`` or all."""
        for kept_thread in sorted(self.trust.kept_checkpoints):
            if kept_thread in self._kept_seen or thread_id not in (None, kept_thread):
                continue
            for version in sorted(self.trust.kept_checkpoints[kept_thread]):
                self.finding(
                    Finding(
                        kept_thread,
                        version,
                        CHECKPOINT,
                        f"a record at version {version} (a signed head kept elsewhere)",
                        "no record of the thread",
                    )
                )

    def headless(self, thread_id: str, head: Head | None) -> None:
        """A thread the source names but holds no record of."""
        self.summary.threads += 1
        expected = "records from genesis"
        if head is None:
            self.finding(Finding(thread_id, None, HEAD, expected, "no head and no records"))
        else:
            found = (
                f"a head at version {_version_text(head.version)} ({head.digest}) but no records"
            )
            self.finding(Finding(thread_id, head.version, HEAD, expected, found))


@dataclass(frozen=True, slots=True)
class _Last:
    version: int
    digest: str
    state_digest: str | None
    state: bytes | None = None  # the record's kept state body, when it verified


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A well-formed record; ``fast`` when its bytes are orjson's own output of it
    inside the canonical fast path (so is every value in it, the patch included)."""

    record: JsonObject
    fast: bool


@dataclass(frozen=True, slots=True)
class _Replay:
    """The state replayed from the previous state and a patch, in canonical bytes;
    ``fast`` when it lies inside the canonical fast path."""

    state: JsonObject
    data: bytes
    fast: bool


class ThreadVerifier:
    """Checks one thread's rows in stored order, holding only the previous record's
    digest and the state after it (either may be unknown after a failure)."""

    def __init__(self, thread_id: str, run: Verification) -> None:
        self.thread_id = thread_id
        self._run = run
        self._trust = run.trust
        self._expected = 0
        self._parent: str | None = GENESIS_PARENT
        self._state: JsonObject | None = {}
        # the state is known to lie inside the canonical fast path: its RFC 8785 form
        # is orjson's, with no walk of the value (the empty state, and what replays
        # fast-path patches onto it)
        self._state_fast = True
        # the state as the compiled lane handed it back, canonical bytes: parsed only
        # when the reference needs the value (a thread the lane took to its end, the
        # common case, never does); while set, it is the state and _state is not
        self._state_data: bytes | None = None
        self._policy_name: str | None = None
        # the state digests of the versions seen so far: what a revert may restore
        self._earlier_states: set[str] = set()
        # and those the lane took, 64 hex digits each run together: read at a revert
        self._earlier_taken: list[str] = []
        self._last: _Last | None = None
        # only read (merged into a dict of its own below, which pops): no copy
        self._kept = self._trust.kept_checkpoints.get(thread_id, {})
        self._checkpoints: dict[int, SignedCheckpoint] = dict(self._kept)

    def expect_checkpoints(
        self,
        checkpoints: Mapping[int, SignedCheckpoint] | Mapping[int | None, SignedCheckpoint],
    ) -> None:
        """Signed heads the chain must pass through (version -> checkpoint), the
        source's own and those kept elsewhere (which win at the same version). One
        with no version (a database's null column: its primary key dropped) is a
        finding: the chain cannot be held to it."""
        if None in checkpoints:
            self._fail(None, CHECKPOINT, "a signed head at a version", "one with a null version")
        versioned = {v: c for v, c in checkpoints.items() if v is not None}
        self._checkpoints = {**versioned, **self._kept}

    def _fail(self, version: int | None, check: str, expected: str, found: str) -> None:
        self._run.finding(Finding(self.thread_id, version, check, expected, found))

    # --- the compiled lane ------------------------------------------------------------

    def lane_start(self, lane: Any) -> bool:
        """Hand the chain to the compiled lane, when it is known (a parent digest and a
        state to replay on): True if the lane holds it now."""
        parent, state, data = self._parent, self._state, self._state_data
        if parent is None or (state is None and data is None) or not HEX_256.match(parent):
            return False
        if not isinstance(self.thread_id, str):
            return False  # a null thread_id (a database's primary key dropped)
        if not 0 <= self._expected <= LANE_VERSIONS:
            return False  # a version beyond the lane's (a hostile one): the reference's
        if data is None:
            try:
                data = canonical_bytes(state)
            except (ValueError, TypeError, RecursionError):
                return False
        # a signed head at a version the lane would reach: the reference checks it
        stop = min((v for v in self._checkpoints if v >= self._expected), default=-1)
        if stop > LANE_VERSIONS:
            stop = -1  # beyond any version the lane takes
        thread = self.thread_id.encode("utf-8", "surrogatepass")
        return bool(lane.start(thread, self._expected, parent, data, self._policy_name, stop))

    def lane_take(self, lane: Any) -> None:
        """Carry on from what the lane took: exactly where the reference would be had it
        checked those lines itself (and found nothing, as the lane did)."""
        records, expected, parent, state, policy_name, earlier, last = lane.take()
        if not records:
            return
        self._run.summary.records += records
        self._expected, self._parent, self._policy_name = expected, parent, policy_name
        self._state, self._state_data = None, state  # canonical: the lane wrote it
        if earlier:
            self._earlier_taken.append(earlier)
        version, digest, state_digest, kept = last
        self._last = _Last(version, digest, state_digest, state if kept else None)

    # --- one row --------------------------------------------------------------------

    def add_unversioned(self) -> None:
        """A database row whose version is null (its primary key dropped): it has no
        place in the chain, which stays as it was (the version it should have had is
        then missing, or there twice, and reported so)."""
        self._run.summary.records += 1
        self._fail(None, VERSION, "a version", "none: a record with a null version column")

    def add(self, row: LedgerRow) -> None:
        self._run.summary.records += 1
        checkpoint = self._checkpoints.pop(row.version, None)
        if checkpoint is not None:
            self._check_checkpoint(row, checkpoint)
        if not self._check_position(row):
            # out of order or repeated: the chain stays as it was
            misplaced = self._check_alone(row)
            if misplaced is not None:
                self._check_state_body(row, misplaced.record, None)
            return
        parsed = self._check_alone(row)
        record = parsed.record if parsed is not None else None
        if parsed is None or parsed.record["version"] != row.version:
            if parsed is not None:
                self._check_state_body(row, parsed.record, None)
            self._last = _Last(row.version, row.digest, _state_digest(record))
            self._lose_track()
            return
        replay = self._replay(parsed)
        body_verified = self._check_state_body(row, parsed.record, replay)
        self._last = _Last(
            row.version,
            row.digest,
            _state_digest(record),
            row.state if body_verified else None,
        )
        self._check_in_chain(row, parsed.record, replay, body_verified)

    def _check_position(self, row: LedgerRow) -> bool:
        """Versions run 0, 1, 2, ...; a gap is reported at the first missing version."""
        expected = self._expected
        if row.version > expected:
            missing = (
                f"{expected}" if row.version == expected + 1 else f"{expected}-{row.version - 1}"
            )
            self._fail(
                expected,
                VERSION,
                f"version {expected}",
                f"version {row.version}: version {missing} is missing",
            )
            self._lose_track()
        elif row.version < expected:
            self._fail(
                row.version,
                VERSION,
                f"version {expected}",
                f"version {row.version} again after version {expected - 1} "
                "(a fork, a repeated or a reordered record)",
            )
            return False
        self._expected = row.version + 1
        return True

    def _lose_track(self) -> None:
        """The previous record is missing or misplaced: re-synchronise on the next one."""
        self._parent = None
        self._state, self._state_data = None, None

    def _current_state(self) -> JsonObject | None:
        """The state after the previous record (None: unknown), parsed from the bytes
        the lane handed back the first time the reference needs it."""
        if self._state_data is not None:
            parsed, _, fast = _parse_canonical(self._state_data)
            self._state, self._state_fast, self._state_data = parsed, fast, None
        return self._state

    def _check_alone(self, row: LedgerRow) -> _Parsed | None:
        """Steps 1-5 and the columns: what holds of a record wherever it stands
        (but its state body, which ``_check_state_body`` checks next). Returns the
        record when it is well formed."""
        version = row.version
        recomputed = sha256_hex(row.record)
        if recomputed != row.digest:
            self._fail(
                version, DIGEST, f"{shown(row.digest)} (stored)", f"{recomputed} (recomputed)"
            )
        record, problem, fast = _parse_canonical(row.record)
        if record is None:
            self._fail(version, CANONICAL, "RFC 8785 JSON of an object", problem)
            if self._trust.keyring is not None:
                self._check_hmac(row, row.key_id, recomputed)
            return None
        if problem:
            self._fail(version, CANONICAL, "the record's RFC 8785 form", problem)
        problems = record_problems(record)
        if problems:
            self._fail(version, FORMAT, "a format 1 or 2 record", "; ".join(problems))
            if self._trust.keyring is not None:
                self._check_hmac(row, row.key_id, recomputed)
            return None
        if self._trust.keyring is not None:
            self._check_hmac(row, record["key_id"], recomputed)
        if record["thread_id"] != self.thread_id:
            self._fail(version, THREAD, self.thread_id, shown(record["thread_id"]))
        if record["version"] != row.version:
            self._fail(
                version,
                VERSION,
                f"version {row.version} (where the record is stored)",
                f"the record says version {record['version']}",
            )
        self._check_columns(row, record)
        self._check_role(version, record)
        self._check_policy(version, record)
        return _Parsed(record, fast and not problem)

    def _check_hmac(self, row: LedgerRow, key_id: str, recomputed: str) -> None:
        assert self._trust.keyring is not None
        try:
            key = self._trust.keyring.key(key_id)
        except KeyError:
            known = ", ".join(self._trust.keyring.key_ids)
            self._fail(
                row.version, KEY_ID, f"one of the keyring's key ids ({known})", shown(key_id)
            )
            return
        digest = row.digest
        signed = digest if digest == recomputed or HEX_256.match(digest) else recomputed
        # as bytes: compare_digest refuses str with characters beyond ASCII, which a
        # hostile signature column may hold
        found = row.signature.encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(sign_digest(key, signed).encode(), found):
            self._fail(
                row.version,
                SIGNATURE,
                f"HMAC-SHA256 under key {key_id!r} of digest {signed}",
                f"{shown(row.signature)}, which does not verify",
            )

    def _check_columns(self, row: LedgerRow, record: JsonObject) -> None:
        """The unsigned copies a query filters on must say what the record says."""
        copies: dict[str, tuple[object, object]] = {
            "parent_digest": (row.parent_digest, record["parent_digest"]),
            "node_id": (row.node_id, record["node_id"]),
            "key_id": (row.key_id, record["key_id"]),
        }
        if row.committed_at is not None:
            copies["committed_at"] = (row.committed_at, record["committed_at"])
        for name, (column, signed) in copies.items():
            if column != signed:
                self._fail(
                    row.version,
                    f"{COLUMN}.{name}",
                    f"{shown(signed)} (the record's)",
                    shown(column),
                )

    def _check_role(self, version: int, record: JsonObject) -> None:
        """The identity that wrote a record has the role its kind needs: an operator (or
        a service) creates a thread, a node proposes a transition, an operator reverts."""
        roles = ROLES_OF_KIND.get(record["kind"])
        if roles is None:
            return  # a kind the format check already reported
        role = role_of(record["node_id"])
        if role not in roles:
            expected = f"an identity of role {' or '.join(roles)} (a {record['kind']} record)"
            self._fail(version, ROLE, expected, shown(record["node_id"]))

    def _check_policy(self, version: int, record: JsonObject) -> None:
        digest = record["policy_digest"]
        policy = self._trust.by_digest.get(digest)
        if policy is None:
            known = ", ".join(f"{p.name} {p.digest}" for p in self._trust.by_digest.values())
            self._fail(version, POLICY, f"the digest of a known policy ({known})", shown(digest))
            return
        if version == 0 or self._policy_name is None:
            self._policy_name = policy.name
        elif policy.name != self._policy_name:
            self._fail(
                version,
                POLICY,
                f"a digest of policy {self._policy_name!r}, which the thread is bound to",
                f"{digest} (policy {policy.name!r})",
            )

    def _check_state_body(self, row: LedgerRow, record: JsonObject, replay: _Replay | None) -> bool:
        """A kept state body must be canonical and hash to the record's state_digest.
        True when it does. When it is byte for byte the replayed state's canonical
        form it is canonical JSON of an object, and only its hash remains to check."""
        if row.state is None:
            return False
        state_digest = record["state_digest"]
        if replay is not None and replay.data == row.state:
            found = sha256_hex(row.state)
            problem = "" if found == state_digest else f"a state body hashing to {found}"
        else:
            problem = _state_problem(row.state, state_digest)
        if problem:
            self._fail(row.version, STATE, f"a state hashing to {state_digest}", problem)
            return False
        return True

    def _replay(self, parsed: _Parsed) -> _Replay | None:
        """The previous state with the record's patch applied, in canonical bytes;
        None when the previous state is unknown."""
        old = self._current_state()
        if old is None:
            return None
        state = apply_patch(old, parsed.record["patch"])
        if self._state_fast and parsed.fast:
            # both inside the fast path, so is the replayed state: no walk needed
            try:
                return _Replay(state, orjson.dumps(state, option=orjson.OPT_SORT_KEYS), True)
            except orjson.JSONEncodeError:
                pass
        return _Replay(state, canonical_bytes(state), False)

    # --- the chain ------------------------------------------------------------------

    def _check_in_chain(
        self, row: LedgerRow, record: JsonObject, replay: _Replay | None, body_verified: bool
    ) -> None:
        """Steps 7 and 10, the risk rules and the receipt: what depends on the
        previous record and state."""
        version = row.version
        if self._parent is not None and record["parent_digest"] != self._parent:
            expected = (
                "64 zeros (genesis)" if version == 0 else f"{self._parent} (version {version - 1})"
            )
            self._fail(version, PARENT, expected, f"{record['parent_digest']}")
        policy = self._trust.by_digest.get(record["policy_digest"])
        old, state, state_fast = self._current_state(), None, False
        if replay is not None:
            state, state_fast = replay.state, replay.fast
            if body_verified and replay.data == row.state:
                replayed = record["state_digest"]  # the same bytes hashed to it just now
            else:
                replayed = sha256_hex(replay.data)
            if replayed != record["state_digest"]:
                self._fail(
                    version,
                    REPLAY,
                    f"{record['state_digest']} (the record's state_digest)",
                    f"{replayed} (replayed from the patches)",
                )
                state = None
        derived = None
        if record["kind"] == KIND_REVERT:
            # an operator's repair: no risk rule applies (the service checks none), so
            # no receipt is expected; it must be an operator's, restoring an earlier state
            self._check_revert(version, record)
        elif version > 0 and old is not None and state is not None and policy is not None:
            derived = self._risk_rules(version, policy, old, state, record)
        carried = record_risk_rules(record)  # format 2: what the service matched
        if carried is None:
            matched = derived
        else:
            self._check_carried_rules(version, record, carried, derived)
            matched = carried  # the receipt's binding needs no CEL evaluator
        self._check_receipt(row, record, matched)
        self._earlier_states.add(record["state_digest"])
        self._parent = row.digest
        if state is not None:
            self._state, self._state_fast = state, state_fast
        else:
            self._state, self._state_fast = _kept_state(row.state, record)

    def _check_carried_rules(
        self, version: int, record: JsonObject, carried: list[str], derived: Matched | None
    ) -> None:
        """A format-2 record's risk_rules must be what its policy's risk rules match on
        the replayed states (when they could be evaluated); a genesis and a revert
        match none."""
        if version == 0 or record["kind"] == KIND_REVERT:
            expected: list[str] | None = []
            why = "none (a genesis or a revert matches no risk rule)"
        else:
            expected = None if derived is None else sorted(derived)
            why = f"{expected} (re-derived from the policy on the replayed states)"
        if expected is not None and carried != expected:
            self._fail(version, RISK_RULES, why, f"{carried} (the record's risk_rules)")

    def _check_revert(self, version: int, record: JsonObject) -> None:
        """What a revert must restore (docs/ledger-format.md): a state the thread had at
        an earlier version (that it is an operator's is the ``role`` check's)."""
        for taken in self._earlier_taken:
            self._earlier_states.update(taken[at : at + 64] for at in range(0, len(taken), 64))
        self._earlier_taken.clear()
        if record["state_digest"] not in self._earlier_states:
            self._fail(
                version,
                REVERT,
                "the state of an earlier version (a revert restores one)",
                f"{record['state_digest']}, which no earlier version had",
            )

    def _risk_rules(
        self, version: int, policy: Policy, old: JsonObject, state: JsonObject, record: JsonObject
    ) -> Matched | None:
        if not policy.risk_rules:
            return ()
        node = record["node_id"].rsplit("/", 1)[-1]
        patch = record["patch"]
        values = {"state": state, "old": old, "patch": patch, "node": node}
        memo = self._run.risk_memo
        key = _risk_key(policy.digest, self._trust.risk_inputs[policy.digest], values)
        if key is not None and (known := memo.get(key)) is not None:
            return known  # a tuple: shared, not copied
        try:
            matched = risk_rules_matched(self._trust, policy, values)
        except RISK_FAILURES as exc:
            self._fail(version, RISK_UNCHECKED, "risk rules that evaluate", f"{type(exc).__name__}")
            return None
        if key is None:
            return matched
        if len(memo) >= RISK_MEMO_SIZE:
            memo.clear()
        memo[key] = found = tuple(matched)
        return found

    def _check_receipt(self, row: LedgerRow, record: JsonObject, matched: Matched | None) -> None:
        version, receipt_digest = row.version, record["receipt_digest"]
        if receipt_digest is None:
            if row.receipt is not None:
                self._fail(
                    version,
                    RECEIPT_UNBOUND,
                    "no stored receipt (the record's receipt_digest is null)",
                    f"a receipt with digest {sha256_hex(row.receipt)}",
                )
            if matched:
                self._fail(
                    version,
                    RISK,
                    f"an approval receipt (matches risk rules: {', '.join(matched)})",
                    "no receipt",
                )
            return
        if row.receipt is None:
            self._fail(version, RECEIPT_MISSING, f"the receipt {receipt_digest}", "none stored")
            return
        found = sha256_hex(row.receipt)
        if found != receipt_digest:
            self._fail(version, RECEIPT_DIGEST, f"{receipt_digest} (the record's)", found)
        receipt = self._verified_receipt(row, record["committed_at"])
        if receipt is not None:
            self._check_binding(record, receipt, matched)

    def _verified_receipt(self, row: LedgerRow, committed_at: str) -> JsonObject | None:
        """The receipt if its signature verifies and it is well formed (expired or not)."""
        version = row.version
        assert row.receipt is not None
        key_id = row.receipt_key_id or ""
        key = self._trust.approval_keys.get(key_id)
        if key is None:
            known = ", ".join(sorted(self._trust.approval_keys)) or "none loaded"
            self._fail(
                version, RECEIPT_SIGNATURE, f"an approval key id ({known})", f"{shown(key_id)}"
            )
            return None
        try:
            key.verify(bytes.fromhex(row.receipt_signature or ""), row.receipt)
        except (InvalidSignature, ValueError):
            self._fail(
                version,
                RECEIPT_SIGNATURE,
                f"an Ed25519 signature under approval key {key_id!r}",
                f"{shown(row.receipt_signature)}, which does not verify",
            )
            return None
        signed = SignedReceipt(row.receipt, row.receipt_signature or "", key_id)
        moment = datetime.fromisoformat(committed_at[:-1] + "+00:00")
        try:
            return verify_receipt(signed, {key_id: key}, now=moment)
        except ReceiptExpired as exc:
            self._fail(version, RECEIPT_EXPIRED, f"valid at {committed_at}", exc.message)
            parsed: JsonObject = json.loads(row.receipt)  # as verify_receipt parsed it
            return parsed
        except ReceiptInvalid as exc:
            self._fail(version, RECEIPT_FORM, "a format 1 approval receipt", exc.message)
            return None

    def _check_binding(
        self, record: JsonObject, receipt: JsonObject, matched: Matched | None
    ) -> None:
        version = record["version"]
        bound = {
            "thread_id": record["thread_id"],
            "base_version": version - 1,
            "decision": APPROVE,
        }
        if matched is not None:
            bound["transition_digest"] = transition_digest(record, matched)
        for name, expected in bound.items():
            if receipt[name] != expected:
                self._fail(
                    version,
                    RECEIPT_BINDING,
                    f"{name} {shown(expected)}",
                    f"{name} {shown(receipt[name])}",
                )

    # --- the head -------------------------------------------------------------------

    def _check_checkpoint(self, row: LedgerRow, checkpoint: SignedCheckpoint) -> None:
        """A signed head must be exactly the record the chain holds at its version."""
        keys = dict(self._trust.checkpoint_keys or {})
        try:
            body = verify_checkpoint(checkpoint, keys)
        except CheckpointInvalid as exc:
            self._fail(row.version, CHECKPOINT, "a checkpoint signed by a known key", exc.message)
            return
        recomputed = sha256_hex(row.record)
        signed = (body["thread_id"], body["version"], body["head_digest"])
        if signed != (self.thread_id, row.version, recomputed):
            self._fail(
                row.version,
                CHECKPOINT,
                f"the signed head {body['head_digest']} at version {body['version']}",
                f"the record here hashes to {recomputed}",
            )

    def check_head(self, head: Head | None) -> None:
        """The source's head must be the last record: nothing after it was removed,
        nothing was appended behind its back."""
        for version in sorted(self._checkpoints):
            self._fail(
                version,
                CHECKPOINT,
                f"a record at version {version} (a signed head)",
                "no record: the chain no longer passes through a signed head",
            )
        self._checkpoints = {}
        last = self._last
        if head is None:
            at = last.version if last else None
            self._fail(at, HEAD, "a head for the thread", "none")
            return
        if last is None:
            return
        if (head.version, head.digest) != (last.version, last.digest):
            self._fail(
                last.version if head.version is None else max(head.version, last.version),
                HEAD,
                f"version {_version_text(head.version)}, digest {head.digest} (the head)",
                f"version {last.version}, digest {last.digest} (the last record)",
            )
            return
        if head.state is not None and last.state_digest is not None:
            # the last record's kept body verified already: the same bytes need no more
            same = last.state is not None and head.state == last.state
            problem = "" if same else _state_problem(head.state, last.state_digest)
            if problem:
                self._fail(
                    head.version, HEAD_STATE, f"a state hashing to {last.state_digest}", problem
                )


@contextlib.contextmanager
def collector_frozen() -> Iterator[None]:
    """For a run: what the process held when it began (its modules, the trust, the
    policies) in the collector's permanent generation, so that the collections the
    run's allocations set off walk only what the run made (they took about 5 % of a
    one-process run's CPU, walking the whole heap). Nothing is frozen, or unfrozen,
    in a process that froze objects already (a ``--jobs`` worker, an application's
    own freeze)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


RISK_FAILURES = (ValueError, TypeError, KeyError, RecursionError)
# the versions the compiled lane takes: at most 15 digits (it declines the others)
LANE_VERSIONS = 10**15 - 1


def risk_rules_matched(trust: Trust, policy: Policy, values: dict[str, Any]) -> list[str]:
    """The policy's risk rules that match the change ``values`` (state, old, patch,
    node); one of ``RISK_FAILURES`` when they cannot be evaluated."""
    # bound as the transition service binds them (ztate.services.policy.changes.Change.of),
    # but only what the risk rules read: the invariants are not re-checked here
    reads = trust.risk_reads[policy.digest]
    bound = bind(reads, values) if reads else None
    change = Change(values["state"], values["old"], values["patch"], values["node"], bound)
    return matched_risk_rules(policy, change)


def compiled_lane(trust: Trust) -> Any:
    """The compiled lane for a run under ``trust`` (None without it). It asks the
    reference what it does not decide itself: whether a node id has the role a
    transition needs, and whether a change matches no risk rule."""
    if LANE is None or trust.reference_only:
        return None
    keyring = trust.keyring
    keys = None if keyring is None else {kid: keyring.key(kid) for kid in keyring.key_ids}
    policies = {
        digest: (
            policy.name,
            bool(policy.risk_rules),
            tuple(
                (var, None if names is None else tuple(sorted(n.encode() for n in names)))
                for var, names in trust.risk_inputs[digest].items()
            ),
        )
        for digest, policy in trust.by_digest.items()
    }

    def role_ok(kind: str, node_id: str) -> bool:
        return role_of(node_id) in ROLES_OF_KIND[kind]

    def no_risk(digest: str, old: bytes, state: bytes, patch: bytes, node_id: str) -> bool:
        values = {
            "state": orjson.loads(state),
            "old": orjson.loads(old),
            "patch": orjson.loads(patch),
            "node": node_id.rsplit("/", 1)[-1],
        }
        try:
            return not risk_rules_matched(trust, trust.by_digest[digest], values)
        except RISK_FAILURES:
            return False  # the reference reports it

    return LANE.Lane(keys, policies, role_ok, no_risk)


# --- record parsing ---------------------------------------------------------------------


def _parse_canonical(data: bytes) -> tuple[JsonObject | None, str, bool]:
    """The parsed object, a problem and whether the canonical fast path holds it:
    (None, why, False) if unusable, (obj, why, False) if usable but not canonical,
    (obj, "", fast) if canonical."""
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return None, f"not JSON ({shown(str(exc))})", False
    if not isinstance(parsed, dict):
        return None, f"a JSON {type(parsed).__name__}, not an object", False
    if orjson_canonical(data, parsed):
        return parsed, "", True
    try:
        canonical = canonical_bytes(parsed)
    except (ValueError, TypeError, RecursionError):
        return None, "values outside the canonical JSON domain", False
    if canonical != data:
        return (
            parsed,
            (
                f"{len(data)} bytes that are not their own RFC 8785 form "
                f"({len(canonical)} bytes, digest {sha256_hex(canonical)})"
            ),
            False,
        )
    return parsed, "", False


def _version_text(version: int | None) -> str:
    return "none (a null column)" if version is None else str(version)


def _state_digest(record: JsonObject | None) -> str | None:
    return record["state_digest"] if record is not None else None


def _state_problem(state: bytes, state_digest: str) -> str:
    """Why ``state`` is not the canonical state hashing to ``state_digest`` ("" if it is)."""
    found = sha256_hex(state)
    parsed, problem, _ = _parse_canonical(state)
    if parsed is None or problem:
        return f"a state body that is not canonical JSON of an object ({problem})"
    if found != state_digest:
        return f"a state body hashing to {found}"
    return ""


def _kept_state(state: bytes | None, record: JsonObject) -> tuple[JsonObject | None, bool]:
    """A kept state body to re-synchronise on, if it is the record's state, and
    whether it lies inside the canonical fast path."""
    if state is None or sha256_hex(state) != record["state_digest"]:
        return None, False
    parsed, problem, fast = _parse_canonical(state)
    if parsed is None or problem:
        return None, False
    return parsed, fast


def _risk_key(digest: str, inputs: Reads, values: dict[str, Any]) -> tuple[str, bytes] | None:
    """The exact JSON of what the policy's risk rules see of ``values`` (None if it
    cannot be written, and then nothing is remembered)."""
    seen: list[Any] = []
    for var, keys in inputs.items():
        value = values[var]
        if keys is not None and isinstance(value, dict):
            value = {key: value[key] for key in keys if key in value}
        seen += (var, value)
    try:
        return digest, orjson.dumps(seen)
    except orjson.JSONEncodeError:
        return None


# --- the database -----------------------------------------------------------------------

# Each row carries the thread's head when it is the head's version. Joining on the
# thread alone lets Postgres merge two primary-key scans with no sort; a thread whose
# head names no stored version gets its head read separately (a failure, so rare).
# Every column is cast to the schema's type: a database is not trusted, and a column
# whose type was altered must reach the checks as the type they read (or fail to
# convert: "reading the ledger failed"), never as another Python type. A cast to the
# column's own type is no cast: the plan is the same.
ROWS = """
SELECT t.thread_id::text AS thread_id, t.version::bigint AS version,
       t.digest::text AS digest, t.parent_digest::text AS parent_digest,
       t.node_id::text AS node_id, t.key_id::text AS key_id, t.signature::text AS signature,
       t.record::bytea AS record, t.state::bytea AS state, t.receipt::bytea AS receipt,
       t.receipt_signature::text AS receipt_signature, t.receipt_key_id::text AS receipt_key_id,
       t.committed_at::timestamptz AS committed_at,
       CASE WHEN h.version = t.version THEN h.version::bigint END AS head_version,
       CASE WHEN h.version = t.version THEN h.head_digest::text END AS head_digest,
       CASE WHEN h.version = t.version THEN h.state::bytea END AS head_state
  FROM ztate.transitions t
  LEFT JOIN ztate.threads h ON h.thread_id = t.thread_id
"""
ALL_ROWS = ROWS + " ORDER BY t.thread_id, t.version"
THREAD_ROWS = ROWS + " WHERE t.thread_id = $1 ORDER BY t.thread_id, t.version"
# the threads from $1 (inclusive) to $2 (exclusive), either open: one worker's share
RANGE_ROWS = (
    ROWS + " WHERE ($1::text IS NULL OR t.thread_id >= $1) AND ($2::text IS NULL OR "
    "t.thread_id < $2) ORDER BY t.thread_id, t.version"
)
# the rows of no thread (a null thread_id: the primary key dropped), which ALL_ROWS
# orders last and no range of thread ids holds: the last range's worker reads them
NULL_THREAD_ROWS = ROWS + " WHERE t.thread_id IS NULL ORDER BY t.version"
HEAD_OF = (
    "SELECT version::bigint AS version, head_digest::text AS head_digest, "
    "state::bytea AS state FROM ztate.threads WHERE thread_id = $1"
)
HEADLESS = """
SELECT h.thread_id::text AS thread_id, h.version::bigint AS version,
       h.head_digest::text AS head_digest
  FROM ztate.threads h
 WHERE ($1::text IS NULL OR h.thread_id = $1)
   AND NOT EXISTS (SELECT 1 FROM ztate.transitions t WHERE t.thread_id = h.thread_id)
 ORDER BY h.thread_id
"""
PREFETCH = 256  # measured: larger batches fetch more slowly
RISK_MEMO_SIZE = 4096
CONNECT_TIMEOUT = 10.0


async def connect(dsn: str) -> asyncpg.Connection:
    """A connection, or ``VerifyError`` naming why there is none (never the DSN)."""
    from ztate.services.store.waiting import first_line

    try:
        return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT)
    except (
        OSError,
        TimeoutError,
        ValueError,  # a DSN the driver cannot parse
        OverflowError,  # a port beyond 65535: the socket layer's refusal
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
    ) as exc:
        said = first_line(exc, dsn)  # the password, and the DSN itself, masked
        raise VerifyError(f"cannot connect to the database: {type(exc).__name__}: {said}") from None


def row_from_db(record: asyncpg.Record) -> LedgerRow:
    """The ledger row of a database row. The schema makes these columns NOT NULL, but a
    database is not trusted: a null (a constraint dropped) is ``NULL``, which no record
    says (a digest, a node id, a time...), so that it is a finding, never a crash."""
    committed_at: datetime | None = record["committed_at"]
    stored = record["record"]
    return LedgerRow(
        thread_id=record["thread_id"],
        version=record["version"],
        digest=_text(record["digest"]),
        parent_digest=_text(record["parent_digest"]),
        node_id=_text(record["node_id"]),
        key_id=_text(record["key_id"]),
        signature=_text(record["signature"]),
        record=b"" if stored is None else bytes(stored),
        state=_bytes_or_none(record["state"]),
        receipt=_bytes_or_none(record["receipt"]),
        receipt_signature=record["receipt_signature"],
        receipt_key_id=record["receipt_key_id"],
        committed_at=NULL if committed_at is None else format_time(committed_at),
    )


NULL = "NULL"  # what a null NOT NULL column reads as (``row_from_db``)


def _text(value: str | None) -> str:
    return NULL if value is None else value


def _bytes_or_none(value: bytes | None) -> bytes | None:
    return None if value is None else bytes(value)


async def verify_database(
    dsn: str, trust: Trust, report: Report, *, thread_id: str | None = None
) -> Summary:
    """Verify every thread (or one) in the database at ``dsn``, in one consistent
    snapshot, reporting each finding as it is found."""
    conn = await connect(dsn)
    try:
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            with collector_frozen():
                return await _verify_snapshot(conn, trust, report, thread_id)
    except asyncpg.UndefinedTableError:
        raise VerifyError("the database holds no ztate ledger (schema ztate is missing)") from None
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()


async def check_policies_are_the_ledgers(
    conn: asyncpg.Connection, trust: Trust, thread_id: str | None
) -> None:
    """Policies none of whose digests a thread of the ledger names are a configuration
    mistake (exit 2), not a ledger with every record failing its policy check."""
    rows = await conn.fetch(
        "SELECT DISTINCT policy_name, policy_digest FROM ztate.threads "
        "WHERE $1::text IS NULL OR thread_id = $1",
        thread_id,
    )
    # threads.policy_digest is the version the thread was created under: after a
    # policy edit, today's version is given by name
    check_policies_named(
        {row["policy_digest"] for row in rows}, trust, {row["policy_name"] for row in rows}
    )


def check_policies_named(named: set[str], trust: Trust, names: Iterable[str] = ()) -> None:
    """``named``: the policy digests a ledger's threads (or a bundle's manifest) name.
    At least one must be a policy given to the verifier: the versions the source
    keeps verify the records that name them, but cannot stand in for a ``--policy``
    that names another ledger's policies."""
    given = {policy.digest: policy for policy in trust.given_policies}
    given_names = {policy.name for policy in given.values()}
    if named and not named & given.keys() and not given_names & set(names):
        loaded = ", ".join(f"{p.name} ({p.digest[:12]})" for p in given.values())
        raise VerifyError(
            f"the policies given are not this ledger's: no thread names {loaded or 'them'}; "
            "check --policy (or ZTATE_POLICY_PATH)"
        )


async def with_stored_policies(conn: asyncpg.Connection, trust: Trust, report: Report) -> Trust:
    """``trust`` knowing the policy versions the database keeps (``ztate.policies``,
    migration 0014; a database without the table keeps none)."""
    try:
        async with conn.transaction():  # a savepoint: a missing table leaves the snapshot usable
            stored = await stored_policy_versions(conn, max_body=MAX_POLICY_BODY)
    except asyncpg.UndefinedTableError:
        return trust
    return admit_policy_versions(trust, stored, report)


async def _verify_snapshot(
    conn: asyncpg.Connection, trust: Trust, report: Report, thread_id: str | None
) -> Summary:
    run = Verification(trust, report)
    trust = run.trust = await with_stored_policies(conn, trust, run.finding)
    await check_policies_are_the_ledgers(conn, trust, thread_id)
    query, args = (ALL_ROWS, ()) if thread_id is None else (THREAD_ROWS, (thread_id,))
    await verify_rows(conn, run, query, args)
    for orphan in await conn.fetch(HEADLESS, thread_id):
        run.headless(orphan["thread_id"], Head(orphan["version"], orphan["head_digest"], None))
    if (
        thread_id is not None
        and run.summary.threads == 0
        and thread_id not in trust.kept_checkpoints
    ):
        raise no_such_thread(thread_id)
    run.kept_threads_missing(thread_id)
    return run.summary


async def verify_rows(
    conn: asyncpg.Connection, run: Verification, query: str, args: tuple[Any, ...]
) -> None:
    """Verify the rows ``query`` returns (``ROWS``, in thread and version order), each
    thread against its head and checkpoints as the database holds them."""
    current: ThreadVerifier | None = None
    head: Head | None = None
    lane = run.lane  # the compiled lane: the rows it confirms whole, it takes
    in_lane = False
    cursor = await conn.cursor(query, *args)
    while rows := await cursor.fetch(PREFETCH):
        at = 0
        while at < len(rows):
            if in_lane:
                at, _, head_at = lane.add_rows(rows, at)
                if head_at >= 0:
                    head = _head_of(rows[head_at])
                if at == len(rows):
                    break
                assert current is not None
                current.lane_take(lane)
                in_lane = False
            stored = rows[at]
            at += 1
            if current is None or stored["thread_id"] != current.thread_id:
                if current is not None:
                    current.check_head(head or await head_from_db(conn, current.thread_id))
                current, head = run.thread(stored["thread_id"]), None
                if run.trust.checkpoint_keys is not None:
                    checkpoints = await checkpoints_from_db(conn, current.thread_id)
                    current.expect_checkpoints(checkpoints)
                if lane is not None and current.lane_start(lane):  # the lane from genesis
                    at, in_lane = at - 1, True
                    continue
            if stored["version"] is None:
                current.add_unversioned()
            else:
                current.add(row_from_db(stored))
            if stored["head_version"] is not None:
                head = _head_of(stored)
            if lane is not None:
                in_lane = current.lane_start(lane)
    if current is not None:
        if in_lane:
            current.lane_take(lane)
        current.check_head(head or await head_from_db(conn, current.thread_id))


def _head_of(stored: asyncpg.Record) -> Head:
    """The thread's head, carried by the row at its version."""
    return Head(stored["head_version"], stored["head_digest"], _bytes_or_none(stored["head_state"]))


def no_such_thread(thread_id: str) -> VerifyError:
    """``--thread`` naming a thread the ledger never had is a usage error (exit 2),
    not an integrity failure: there is nothing to verify, and nothing wrong with it."""
    return VerifyError(f"the ledger has no thread {shown(thread_id)}: check --thread")


async def head_from_db(conn: asyncpg.Connection, thread_id: str) -> Head | None:
    row = await conn.fetchrow(HEAD_OF, thread_id)
    if row is None:
        return None
    return Head(row["version"], row["head_digest"], _bytes_or_none(row["state"]))


async def checkpoints_from_db(
    conn: asyncpg.Connection, thread_id: str
) -> dict[int | None, SignedCheckpoint]:
    rows = await conn.fetch(
        "SELECT version::bigint AS version, checkpoint::bytea AS checkpoint, "
        "signature::text AS signature, key_id::text AS key_id "
        "FROM ztate.checkpoints WHERE thread_id = $1",
        thread_id,
    )
    return {
        # a null column (its NOT NULL dropped) is what no checkpoint says, as in row_from_db
        row["version"]: SignedCheckpoint(
            _bytes_or_none(row["checkpoint"]) or b"", _text(row["signature"]), _text(row["key_id"])
        )
        for row in rows
    }
