"""The proposal pipeline's own CPU per proposal, without I/O.

Two views of one cost. Step by step: the pure functions ``TransitionPipeline``
calls on the way to a commit, in its order (parse with I-JSON checks, allowlist,
schema, credentials, layers, apply, bind the CEL values, invariants, canonical
state and its digest, risk rules, build the record, seal it). In total: the real
``TransitionPipeline.propose`` over a store that accepts every commit at once, so
the glue between the steps (identity and field checks, the request digest, the
head cache, the outcome) is measured too. ``rfc8785.dumps`` of the same patch is
the reference: one canonical encoding by the reference implementation.

The policy is the default one, except that the receipt key's ``max_length`` is
raised so that a 10 KB patch exists at all; a bound is a number, so this changes
no cost. Times are this thread's CPU clock, not wall time, and the fastest of a
few calibrated batches, so other processes disturb them little, though a busy
machine still slows the caches and the core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import rfc8785
import yaml

from bench.workload import (
    INITIAL_STATE,
    OPERATOR_NAME,
    TRUST_DOMAIN,
    WRITER_NODE,
    WRITTEN_KEY,
    receipt_patch,
)
from ztate.contract.canonical import canonical_bytes, parse_object, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import Change, apply_patch, check_invariants, matched_risk_rules
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.interface import Commit, Creation
from ztate.services.store.rows import Rejection
from ztate.transition_service.checks import (
    check_credentials,
    check_layers,
    check_schema,
    check_writable,
)
from ztate.transition_service.pipeline import TransitionPipeline
from ztate.transition_service.requests import Committed, Proposal
from ztate.worker_sdk import encode_json

BATCH_SECONDS = 0.03
BATCHES = 7
WIDENED_MAX_LENGTH = 16 * 1024
SUM_STEP = "sum of the steps above"
TOTAL_STEP = "pipeline total (TransitionPipeline.propose, no I/O)"
REFERENCE_STEP = "reference: rfc8785.dumps(patch)"
THREAD_ID = "t-bench"

Call = Callable[[], object]


@dataclass(frozen=True)
class Payload:
    """One patch the pipeline is timed on."""

    name: str
    patch: dict[str, Any]

    @property
    def patch_json(self) -> bytes:
        return encode_json(self.patch)


PAYLOADS = (Payload("1 KB", receipt_patch(1024)), Payload("10 KB", receipt_patch(10 * 1024)))


@dataclass(frozen=True)
class CpuTable:
    """Microseconds of CPU per call, by step and payload name (None: refused)."""

    payloads: tuple[Payload, ...]
    rows: dict[str, dict[str, float | None]]
    refusals: dict[str, str]
    """The reason the pipeline gave, by the name of each payload it refused."""


def widened_policy(path: Path) -> Policy:
    """The policy at ``path`` with the written key's ``max_length`` raised."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document["keys"][WRITTEN_KEY]["max_length"] = WIDENED_MAX_LENGTH
    return Policy.from_mapping(document, source=f"{path} (bench: {WRITTEN_KEY} widened)")


def cpu_micros(call: Call) -> float:
    """CPU microseconds of one call: the fastest of a few calibrated batches.

    Interference (a busy neighbour slowing the caches, a preempted batch) only
    ever adds time, so the fastest batch is the best estimate of the cost itself.
    """
    per_call = _thread_seconds(call, 10) / 10
    count = max(10, int(BATCH_SECONDS / max(per_call, 1e-9)))
    return min(_thread_seconds(call, count) / count for _ in range(BATCHES)) * 1e6


def _thread_seconds(call: Call, count: int) -> float:
    began = time.thread_time()
    for _ in range(count):
        call()
    return time.thread_time() - began


def step_calls(payload: Payload, policy: Policy, keyring: Keyring) -> dict[str, Call]:
    """The pure steps of one proposal, in pipeline order, on prepared inputs.

    The head already holds an earlier receipt, as it does in the steady state of
    the end-to-end run.
    """
    patch_json = payload.patch_json
    patch = parse_object(patch_json, what="patch")
    head = apply_patch(INITIAL_STATE, patch)
    state = apply_patch(head, patch)
    change = Change.of(policy, state, head, patch, WRITER_NODE)
    state_bytes = canonical_bytes(state)
    record = partial(
        build_record,
        kind=KIND_TRANSITION,
        thread_id=THREAD_ID,
        version=2,
        parent_digest=sha256_hex(b"parent"),
        node_id=Identity(TRUST_DOMAIN, Role.NODE, WRITER_NODE).spiffe_id,
        patch=patch,
        state_digest=sha256_hex(state_bytes),
        policy_digest=policy.digest,
        receipt_digest=None,
        key_id=keyring.current,
        committed_at=datetime.now(UTC),
    )
    built = record()
    return {
        "parse_object (UTF-8, JSON, I-JSON checks)": partial(parse_object, patch_json, what="-"),
        "allowlist (check_writable)": partial(check_writable, patch, policy.writable(WRITER_NODE)),
        "check_schema (typed keys)": partial(check_schema, patch, policy),
        "check_credentials": partial(check_credentials, patch, policy),
        "check_layers": partial(check_layers, patch, policy, WRITER_NODE),
        "apply_patch": partial(apply_patch, head, patch),
        "bind the CEL values (Change.of)": partial(
            Change.of, policy, state, head, patch, WRITER_NODE
        ),
        "check_invariants (CEL)": partial(check_invariants, policy, change),
        "canonical_bytes(state)": partial(canonical_bytes, state),
        "sha256(state)": partial(sha256_hex, state_bytes),
        "matched_risk_rules (CEL)": partial(matched_risk_rules, policy, change),
        "build_record": record,
        "seal (canonical record, sha256, HMAC)": partial(seal, built, keyring),
    }


class _AcceptingStore:
    """A store whose every write succeeds at once, so only the pipeline's CPU remains."""

    async def create_thread(self, *_args: object, **_kwargs: object) -> Creation:
        return Creation.CREATED

    async def commit(self, *_args: object, **_kwargs: object) -> Commit:
        return Commit.COMMITTED

    async def record_rejection(self, rejection: Rejection) -> None:
        """A refusal reaches the caller as an error; the table says which and why."""


def _finish(coroutine: Any) -> Any:
    """Run a coroutine that never suspends (its store answers at once) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the pipeline waited on something: it is not measurable without I/O")


def propose_call(payload: Payload, policy: Policy, keyring: Keyring) -> Call:
    """One full ``propose`` per call, each on the head the previous one committed."""
    pipeline = TransitionPipeline(
        store=_AcceptingStore(),  # type: ignore[arg-type]
        policies=PolicySet([policy]),
        keyring=keyring,
        max_patch_bytes=64 * 1024,
        max_depth=32,
        head_cache_size=16,
    )
    operator = Identity(TRUST_DOMAIN, Role.OPERATOR, OPERATOR_NAME)
    worker = Identity(TRUST_DOMAIN, Role.NODE, WRITER_NODE)
    _finish(pipeline.create_thread(operator, THREAD_ID, policy.name, encode_json(INITIAL_STATE)))
    patch_json = payload.patch_json
    version = 0

    def propose() -> None:
        nonlocal version
        proposal = Proposal(THREAD_ID, version, patch_json, f"bench-{version}")
        outcome = _finish(pipeline.propose(worker, proposal))
        if not isinstance(outcome, Committed):
            raise RuntimeError(f"the bench's proposal was not committed: {outcome!r}")
        version = outcome.transition.version

    return propose


def _measure_or_refusal(call: Call) -> float | str:
    """CPU microseconds of ``call``, or the reason code it is refused with."""
    try:
        call()
    except errors.ZtateError as refusal:
        return refusal.reason
    return cpu_micros(call)


def measure_payload(payload: Payload, policy: Policy, keyring: Keyring) -> dict[str, float | str]:
    """Every step, their sum, the real pipeline and the reference, for one payload."""
    results = {
        name: _measure_or_refusal(call)
        for name, call in step_calls(payload, policy, keyring).items()
    }
    timed = [value for value in results.values() if not isinstance(value, str)]
    if len(timed) == len(results):
        results[SUM_STEP] = sum(timed)
    results[TOTAL_STEP] = _measure_or_refusal(propose_call(payload, policy, keyring))
    results[REFERENCE_STEP] = cpu_micros(partial(rfc8785.dumps, payload.patch))
    return results


def measure_pipeline_cpu(policy_file: Path, keyring: Keyring) -> CpuTable:
    policy = widened_policy(policy_file)
    rows: dict[str, dict[str, float | None]] = {}
    refusals: dict[str, str] = {}
    for payload in PAYLOADS:
        for step, value in measure_payload(payload, policy, keyring).items():
            if isinstance(value, str):
                refusals[payload.name] = value
            rows.setdefault(step, {})[payload.name] = None if isinstance(value, str) else value
    return CpuTable(PAYLOADS, rows, refusals)
