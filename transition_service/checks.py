"""The checks of the transition service, each a small function with one reason code.

The pipeline (``ztate.transition_service.pipeline``) runs them top to bottom on every
proposal; the decisions module runs them again on an approved proposal before it
commits, and the reads hide other workflows' threads with them.
"""

from __future__ import annotations

import hashlib
import re

from ztate.contract.canonical import JsonObject, parse_object
from ztate.contract.errors import ContractError
from ztate.services.policy.credentials import find_credential, shown_name
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.policy.schema import TypeMismatch
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.thread_ids import check_thread_id
from ztate.services.store.rows import Head
from ztate.transition_service.heads import CachedHead
from ztate.transition_service.requests import Proposal, Revert

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,128}\Z")
# Only operators administer threads and read whole states or the ledger; the
# services talk to each other through their own calls (the approval service may
# deliver decisions, nothing else).
PRIVILEGED = frozenset({Role.OPERATOR})


# --- the checks, each with its own reason -------------------------------------------


def parse_admitted(data: bytes, what: str, max_depth: int) -> JsonObject:
    """``data`` as an I-JSON object (PATCH_MALFORMED or VALUE_OUT_OF_RANGE otherwise),
    a duplicate member named as the rejections ledger may show an attacker's name."""
    try:
        return parse_object(data, what=what, max_depth=max_depth, shown_name=shown_name)
    except ContractError as exc:
        raise errors.from_contract(exc) from None


def check_privileged(caller: Identity, action: str) -> None:
    if caller.role not in PRIVILEGED:
        raise errors.RoleForbidden(f"a {caller.role} identity may not {action}")


def check_revert_fields(revert: Revert) -> None:
    check_thread_id(revert.thread_id)
    if not IDEMPOTENCY_KEY.match(revert.idempotency_key):
        raise errors.RequestInvalid("idempotency_key must be 1-128 printable ASCII characters")


def check_revert_target(revert: Revert, head_version: int) -> None:
    if not 0 <= revert.to_version < head_version:
        raise errors.RequestInvalid(
            f"to_version must be an earlier version, 0 to {head_version - 1}; "
            f"found {revert.to_version}"
        )


def restoring_patch(current: JsonObject, target: JsonObject) -> JsonObject:
    """The patch that turns ``current`` into ``target``: every key of ``target`` set,
    every key ``target`` lacks removed."""
    patch: JsonObject = dict(target)
    patch.update(dict.fromkeys(current.keys() - target.keys()))
    return patch


def revert_digest(revert: Revert) -> str:
    """What makes two revert requests with one idempotency key the same request."""
    return hashlib.sha256(b"revert\n%d" % revert.to_version).hexdigest()


def check_registered(caller: Identity, policies: PolicySet) -> Policy:
    """The caller is a node registered in a policy; returns that policy."""
    if caller.role is not Role.NODE:
        raise errors.RoleForbidden(f"a {caller.role} identity may not propose transitions")
    policy = policies.of_node(caller.name)
    if policy is None:
        raise errors.NodeNotRegistered(f"node {caller.name!r} is not registered in any policy")
    return policy


def key_reused() -> errors.IdempotencyKeyReused:
    return errors.IdempotencyKeyReused(
        "idempotency_key was already used by this node on this thread for a different request"
    )


def thread_not_found(thread_id: str) -> errors.ThreadNotFound:
    return errors.ThreadNotFound(f"thread {thread_id!r} does not exist")


def check_bound_policy(caller: Identity, policy: Policy, head: Head | CachedHead) -> None:
    """The thread is bound to the caller's policy.

    The caller is told the thread does not exist, exactly as if it did not, so that
    nodes cannot probe which thread ids other workflows use; the rejections ledger
    records the real reason.
    """
    if head.policy_name != policy.name:
        raise errors.PolicyMismatch(
            f"node {caller.name!r} belongs to policy {policy.name!r}; the thread is bound "
            f"to {head.policy_name!r}"
        )


def hide_foreign_thread(caller: Identity, policy: Policy, head: Head) -> None:
    """For reads: a thread of another workflow is "not found", exactly as an absent one
    (``check_bound_policy``), so nodes cannot probe which ids other workflows use."""
    try:
        check_bound_policy(caller, policy, head)
    except errors.PolicyMismatch:
        raise thread_not_found(head.thread_id) from None


def check_proposal_fields(proposal: Proposal) -> None:
    check_thread_id(proposal.thread_id)
    if proposal.expected_version < 0:
        raise errors.RequestInvalid("expected_version must be >= 0")
    if not IDEMPOTENCY_KEY.match(proposal.idempotency_key):
        raise errors.RequestInvalid("idempotency_key must be 1-128 printable ASCII characters")


def check_storable(value: JsonObject, what: str, source: bytes | None = None) -> None:
    """No U+0000 in any string or member name, at any depth.

    It is valid JSON and I-JSON (RFC 8785's own test data holds it), but PostgreSQL's
    jsonb and text cannot hold it: refused here, with its own reason, before any other
    check could copy it into a rejection row or a commit could fail on it. ``source``,
    the JSON text ``value`` was parsed from, spares the walk when it has no ``\\u0000``:
    JSON text cannot hold a raw U+0000 (the parser refuses control characters), so
    that escape is the only way one gets in.
    """
    if source is not None and b"\\u0000" not in source:
        return
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if any("\x00" in key for key in item):
                raise errors.UnsupportedCharacter(f"{what} has a member name holding U+0000")
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and "\x00" in item:
            raise errors.UnsupportedCharacter(f"{what} has a string holding U+0000")


def check_state_size(state_bytes: bytes, limit: int) -> None:
    """The state a change would make stays readable: every reply that carries it is
    bounded by this limit (``Settings.max_reply_bytes``)."""
    if len(state_bytes) > limit:
        # not its size: the state holds keys the node may not read, and their length
        # is theirs to keep (crossing the limit is itself one bit, as a rule's verdict)
        raise errors.StateTooLarge(
            f"the resulting state would be larger than the limit of {limit} bytes",
            limit=limit,
        )


def check_size(data: bytes, limit: int, what: str) -> None:
    if len(data) > limit:
        raise errors.PatchTooLarge(
            f"{what} is {len(data)} bytes; the limit is {limit}", limit=limit
        )


def check_writable(patch: JsonObject, writable: frozenset[str]) -> None:
    if not patch:
        raise errors.RequestInvalid("patch is empty: it changes nothing")
    refused = sorted(shown_name(key) for key in patch.keys() - writable)
    if refused:
        raise errors.KeyNotWritable(
            f"patch writes keys outside this node's write allowlist: {errors.named(refused)}",
            keys=refused,
        )


def check_declared(state: JsonObject, policy: Policy) -> None:
    unknown = sorted(shown_name(key) for key in policy.unknown_keys(state))
    if unknown:
        raise errors.KeyUnknown(
            f"keys not declared in the policy: {errors.named(unknown)}", keys=unknown
        )


def check_schema(members: JsonObject, policy: Policy) -> None:
    try:
        policy.validator.check(members)
    except TypeMismatch as mismatch:
        raise errors.SchemaViolation(
            f"values do not fit their declared types: {mismatch}", keys=mismatch.keys
        ) from None


def check_credentials(members: JsonObject, policy: Policy) -> None:
    for key, value in members.items():
        if value is None:
            continue
        finding = find_credential(value, high_entropy=key not in policy.opaque_keys)
        if finding is not None:
            where = f" at {finding.path}" if finding.path else ""
            raise errors.CredentialDetected(
                f"the value of {key!r}{where} looks like a credential ({finding.kind}); "
                "secrets never enter state (mark the key opaque if it holds digests or "
                "random ids)",
                keys=[key],
            )


def check_layers(patch: JsonObject, policy: Policy, node: str) -> None:
    """Defence in depth: policy loading already refuses such grants."""
    node_layer = policy.node_layer(node)
    for key in patch:
        layer = policy.key_layer(key)
        if layer.immutable:
            raise errors.LayerViolation(
                f"{key!r} is a {layer} key: it is set when the thread is created and never changes",
                keys=[key],
            )
        if layer.rank < node_layer.rank:
            raise errors.LayerViolation(
                f"{key!r} is in layer {layer}, above this node's layer {node_layer}",
                keys=[key],
            )


def request_digest(proposal: Proposal) -> str:
    """What makes two requests with one idempotency key the same request."""
    hasher = hashlib.sha256(b"%d\n" % proposal.expected_version)
    hasher.update(proposal.patch_json)
    return hasher.hexdigest()


# --- the pipeline ---------------------------------------------------------------------
