"""The threat, turned into tests: every way of abusing a node's output fails closed.

Everything runs over real gRPC with real certificates against the session's
service, which loads the pipeline policy (services/defaults/policy.yaml) beside
the billing policy (tests/policies/billing.yaml). Each refusal asserts the
precise error (SDK class, reason, gRPC code, keys or rules), that the head, the
ledger, the proposer's view and the full state are unchanged, and that exactly
one rejection row names the authenticated caller and the reason
(``helpers.refused``). Each risky change asserts it was parked with its exact
proposal, never committed (``helpers.Env.parked``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from tests.adversarial.helpers import (
    Actor,
    Env,
    Expect,
    assert_digest,
    connected,
    observe,
    pending_rows,
    wire,
)
from tests.harness import INITIAL, NODES, USER, Ledger, Pki, act, new_thread_id
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Role
from ztate.transition_service.app import start
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import (
    AwaitingApproval,
    InvalidRequest,
    InvariantViolated,
    NotFound,
    PermissionDenied,
    StaleVersion,
)
from ztate.worker_sdk.errors import from_rpc_error

PARSER, PLANNER, GATE, WRITER = NODES


def by_digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()[:16]


NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVOICER = "invoicer"
TYPED_WRITER = "typed-writer"
OTHER_USER = "9f1c2b3a-4d5e-4f60-8a7b-0c1d2e3f4a5b"
CUSTOMER = "0a0b0c0d-1e1f-4a2b-9c3d-4e5f6a7b8c9d"
BILLING_INITIAL = {"invoice_total_cents": 1200, "invoice_note": "march", "customer_id": CUSTOMER}
TYPED_POLICY = Path(__file__).resolve().parent / "policies" / "typed.yaml"
TYPED_INITIAL = {"persona": "careful", "flag": False, "count": 1}

PERMISSION = grpc.StatusCode.PERMISSION_DENIED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
MALFORMED = Expect(InvalidRequest, "PATCH_MALFORMED", INVALID)
OUT_OF_RANGE = Expect(InvalidRequest, "VALUE_OUT_OF_RANGE", INVALID)
# Told "no such thread", exactly as for a thread that does not exist; recorded as it is.
POLICY_MISMATCH = Expect(NotFound, "THREAD_NOT_FOUND", NOT_FOUND, recorded="POLICY_MISMATCH")
ROLE_FORBIDDEN = Expect(PermissionDenied, "ROLE_FORBIDDEN", PERMISSION)
KEY_REUSED = Expect(InvalidRequest, "IDEMPOTENCY_KEY_REUSED", INVALID)


def not_writable(*keys: str) -> Expect:
    return Expect(PermissionDenied, "KEY_NOT_WRITABLE", PERMISSION, keys=tuple(sorted(keys)))


def schema(*keys: str) -> Expect:
    return Expect(InvalidRequest, "SCHEMA_VIOLATION", INVALID, keys=tuple(sorted(keys)))


def credential(key: str) -> Expect:
    return Expect(InvalidRequest, "CREDENTIAL_DETECTED", INVALID, keys=(key,))


def invariant(*rules: str) -> Expect:
    return Expect(
        InvariantViolated, "INVARIANT_VIOLATED", grpc.StatusCode.FAILED_PRECONDITION, rules=rules
    )


def plan(
    order_id: str = "A-42", amount: int | None = 1500, action: str = "refund"
) -> dict[str, Any]:
    """A pending_transition the planner may write (no target_user_id: that is risky)."""
    planned: dict[str, Any] = {"action": action, "order_id": order_id}
    if amount is not None:
        planned["amount_cents"] = amount
    return planned


@pytest_asyncio.fixture(scope="module")
async def env(target: str, pki: Pki, ledger: Ledger) -> AsyncIterator[Env]:
    async with AsyncExitStack() as stack:
        actors: dict[str, Actor] = {}
        for name in (*NODES, INVOICER):
            actors[name] = await stack.enter_async_context(connected(target, pki, Role.NODE, name))
        actors["operator"] = await stack.enter_async_context(
            connected(target, pki, Role.OPERATOR, "admin")
        )
        yield Env(ledger, actors)


@pytest_asyncio.fixture
async def thread(env: Env) -> str:
    return await env.thread(INITIAL)


@pytest_asyncio.fixture
async def planned(env: Env) -> str:
    """A pipeline thread at version 1: the planner has planned a 15.00 refund of A-42."""
    thread_id = await env.thread(INITIAL)
    await env[PLANNER].client.propose(thread_id, 0, {"pending_transition": plan()})
    return thread_id


# --- 1. a parser that returns keys outside its allowlist -------------------------------


@pytest.mark.parametrize(
    ("patch", "keys"),
    [
        ({"is_admin": True}, ("is_admin",)),
        ({"requested_action": act("refund"), "is_admin": True}, ("is_admin",)),
        (
            {"requested_action": act("x"), "execution_permissions": ["refund", "cancel_order"]},
            ("execution_permissions",),
        ),
        ({"target_user_id": OTHER_USER}, ("target_user_id",)),
        ({"target_user_id": None}, ("target_user_id",)),
        (
            {
                "requested_action": act("x"),
                "is_admin": True,
                "execution_permissions": ["refund"],
                "target_user_id": OTHER_USER,
            },
            ("execution_permissions", "is_admin", "target_user_id"),
        ),
        # JSON escapes decode before the allowlist looks: no name aliasing
        (b'{"requested_action": {"action": "none"}, "is\\u005fadmin": true}', ("is_admin",)),
        # look-alike names are other names, not the allowed one
        ({"requested_act\u0456on": act("x")}, (by_digest("requested_act\u0456on"),)),
        ({"Requested_Action": act("x")}, (by_digest("Requested_Action"),)),
        # attacker-chosen names that are not plain key names are shown by digest only
        ({"AKIAIOSFODNN7EXAMPLE": 1}, (by_digest("AKIAIOSFODNN7EXAMPLE"),)),
    ],
    ids=[
        "is-admin",
        "is-admin-beside-allowed",
        "execution-permissions",
        "target-user-id",
        "target-user-id-removal",
        "all-three",
        "escaped-name",
        "homoglyph-name",
        "case-variant",
        "credential-as-name",
    ],
)
async def test_parser_output_outside_its_allowlist_is_refused_whole(
    env: Env, thread: str, patch: dict[str, Any] | bytes, keys: tuple[str, ...]
) -> None:
    error, row = await env.refused(PARSER, thread, patch, not_writable(*keys))
    assert OTHER_USER not in error.message
    assert OTHER_USER not in row["message"]
    state = await env.state(thread)
    assert state == INITIAL
    assert "is_admin" not in state
    assert state["target_user_id"] == USER


# --- 2. wrong types against the strict schema ------------------------------------------


def _amount(key: str, value: Any) -> dict[str, Any]:
    return {key: {"action": "refund", "order_id": "A-42", "amount_cents": value}}


def _order(key: str, order_id: Any) -> dict[str, Any]:
    return {key: {"action": "lookup", "order_id": order_id}}


RA, PT, AA = "requested_action", "pending_transition", "approved_action"
FIVE_PERMISSIONS = ["read_orders", "refund", "cancel_order", "update_address", "refund"]
EXPONENT = b'{"pending_transition": {"action": "refund", "order_id": "A-42", "amount_cents": 1e2}}'

# (node, patch, the path the message names: its first part is the key at fault)
SCHEMA_CASES = [
    pytest.param(PARSER, _amount(RA, "1"), "requested_action.amount_cents", id="str-for-int"),
    pytest.param(PARSER, _amount(RA, True), "requested_action.amount_cents", id="bool-for-int"),
    pytest.param(GATE, _amount(AA, 12.5), "approved_action.amount_cents", id="12.5-for-int"),
    pytest.param(GATE, _amount(AA, 12.0), "approved_action.amount_cents", id="12.0-for-int"),
    pytest.param(PLANNER, EXPONENT, "pending_transition.amount_cents", id="1e2-for-int"),
    pytest.param(PARSER, _amount(RA, 10_000_001), "requested_action.amount_cents", id="over-max"),
    pytest.param(PLANNER, _amount(PT, -1), "pending_transition.amount_cents", id="under-min"),
    pytest.param(
        PLANNER, {PT: {**plan(), "reason": 42}}, "pending_transition.reason", id="int-for-str"
    ),
    pytest.param(WRITER, {"result_ref": 7}, "result_ref", id="int-for-str-key"),
    pytest.param(PARSER, _order(RA, None), "requested_action.order_id", id="null-member"),
    pytest.param(
        PARSER, {RA: {"action": "delete_everything"}}, "requested_action.action", id="enum"
    ),
    pytest.param(PARSER, {RA: {"action": "Refund"}}, "requested_action.action", id="enum-case"),
    pytest.param(
        GATE, {AA: {**plan(), "action": "none"}}, "approved_action.action", id="enum-other"
    ),
    pytest.param(PLANNER, {"target_user_id": "not-a-uuid"}, "target_user_id", id="uuid-malformed"),
    pytest.param(
        PLANNER, {"target_user_id": OTHER_USER.replace("-", "")}, "target_user_id", id="uuid-bare"
    ),
    pytest.param(
        PLANNER, {"target_user_id": OTHER_USER.upper()}, "target_user_id", id="uuid-upper"
    ),
    pytest.param(
        PLANNER, {"target_user_id": OTHER_USER + "\n"}, "target_user_id", id="uuid-newline"
    ),
    pytest.param(PLANNER, {"target_user_id": 123}, "target_user_id", id="uuid-int"),
    pytest.param(
        PARSER, {RA: {**act("x"), "is_admin": True}}, "requested_action.is_admin", id="extra-member"
    ),
    pytest.param(
        GATE, {AA: {**plan(), "approved_by": PLANNER}}, "approved_action.approved_by", id="extra-2"
    ),
    pytest.param(PLANNER, {PT: {"action": "refund"}}, "pending_transition.order_id", id="missing"),
    pytest.param(PARSER, {RA: {"order_id": "A-42"}}, "requested_action.action", id="missing-2"),
    pytest.param(PARSER, {RA: "refund A-42"}, "requested_action", id="str-for-object"),
    pytest.param(PARSER, {RA: [act("x")]}, "requested_action", id="list-for-object"),
    pytest.param(
        PLANNER, {PT: {**plan(), "reason": "x" * 501}}, "pending_transition.reason", id="too-long"
    ),
    pytest.param(PARSER, _order(RA, "A" * 33), "requested_action.order_id", id="too-long-2"),
    pytest.param(GATE, {"approval_receipt": "r" * 4097}, "approval_receipt", id="too-long-opaque"),
    pytest.param(
        GATE, {"execution_permissions": FIVE_PERMISSIONS}, "execution_permissions", id="5-items"
    ),
    pytest.param(
        GATE,
        {"execution_permissions": ["read_orders", "admin"]},
        "execution_permissions.1",
        id="item-outside-enum",
    ),
    pytest.param(
        GATE, {"execution_permissions": "refund"}, "execution_permissions", id="str-for-list"
    ),
    pytest.param(PARSER, _order(RA, "a-42"), "requested_action.order_id", id="pattern-lower"),
    pytest.param(PLANNER, _order(PT, "A 42"), "pending_transition.order_id", id="pattern-space"),
    pytest.param(PARSER, _order(RA, "A-42\n"), "requested_action.order_id", id="pattern-newline"),
    pytest.param(PARSER, _order(RA, ""), "requested_action.order_id", id="pattern-empty"),
    pytest.param(WRITER, {"result_ref": "orders/42"}, "result_ref", id="url-scheme"),
    pytest.param(WRITER, {"result_ref": "db://o/42 DROP TABLE"}, "result_ref", id="url-space"),
    pytest.param(WRITER, {"result_ref": "db://" + "a" * 252}, "result_ref", id="url-too-long"),
]


@pytest.mark.parametrize(("node", "patch", "path"), SCHEMA_CASES)
async def test_values_that_do_not_fit_their_type_are_refused(
    env: Env, thread: str, node: str, patch: dict[str, Any] | bytes, path: str
) -> None:
    error, row = await env.refused(node, thread, patch, schema(path.split(".")[0]))
    assert path in error.message, error.message
    assert row["message"] == error.message
    for marker in ("delete_everything", "not-a-uuid", "DROP TABLE", "x" * 501):
        assert marker not in error.message


async def test_every_key_at_fault_is_named(env: Env, thread: str) -> None:
    patch = {
        "pending_transition": {"action": "refund"},
        "target_user_id": "nobody",
    }
    error, _ = await env.refused(
        PLANNER, thread, patch, schema("pending_transition", "target_user_id")
    )
    assert "pending_transition.order_id" in error.message


async def test_values_at_their_bounds_commit(env: Env, thread: str) -> None:
    """The near misses above are refused for the right reason: these fit exactly."""
    planner, gate, writer = env[PLANNER].client, env[GATE].client, env[WRITER].client
    await planner.propose(
        thread, 0, {"pending_transition": {**plan(amount=0), "reason": "x" * 500}}
    )
    await gate.propose(thread, 1, {"approval_receipt": "r" * 4096})
    await writer.propose(thread, 2, {"result_ref": "db://" + "a" * 251})
    assert (await env.ledger.snapshot(thread)).head_version == 3


DEEP_ARRAYS = b'{"requested_action": ' + b"[" * 32 + b"]" * 32 + b"}"
DEEP_OBJECTS = b'{"pending_transition": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}"
# deep enough to exhaust the parser's recursion, and still under the planner's size limit
DEEPEST = b'{"pending_transition": ' + b"[" * 8000 + b"]" * 8000 + b"}"
NOT_UTF8 = b'{"requested_action": {"action": "\xff\xfe"}}'
OVERLONG_SLASH = b'{"requested_action": {"action": "\xc0\xaf"}}'
LATIN_1 = '{"pending_transition": {"reason": "caf\xe9"}}'.encode("latin-1")
UTF_16 = '{"requested_action": {"action": "none"}}'.encode("utf-16")
BOM = b'\xef\xbb\xbf{"requested_action": {"action": "none"}}'
DUPLICATE = b'{"requested_action": {"action": "lookup"}, "requested_action": {"action": "refund"}}'
DUPLICATE_NESTED = b'{"requested_action": {"action": "lookup", "action": "refund"}}'
DUPLICATE_ESCAPED = (
    b'{"requested_action": {"action": "lookup"}, "requested\\u005faction": {"action": "refund"}}'
)
DUPLICATE_GRANT = b'{"execution_permissions": ["read_orders"], "execution_permissions": ["refund"]}'

# (node, raw patch, expected refusal, fragment of the message)
PARSE_CASES = [
    pytest.param(PARSER, DEEP_ARRAYS, OUT_OF_RANGE, "nests deeper than 32 levels", id="deep"),
    pytest.param(PLANNER, DEEP_OBJECTS, OUT_OF_RANGE, "nests deeper", id="deep-objects"),
    pytest.param(PLANNER, DEEPEST, OUT_OF_RANGE, "nests deeper", id="deepest"),
    pytest.param(PARSER, NOT_UTF8, MALFORMED, "not valid UTF-8", id="not-utf8"),
    pytest.param(PARSER, OVERLONG_SLASH, MALFORMED, "not valid UTF-8", id="overlong-utf8"),
    pytest.param(PLANNER, LATIN_1, MALFORMED, "not valid UTF-8", id="latin-1"),
    pytest.param(PARSER, UTF_16, MALFORMED, "not valid UTF-8", id="utf-16"),
    pytest.param(PARSER, BOM, MALFORMED, "not valid JSON", id="byte-order-mark"),
    pytest.param(PARSER, DUPLICATE, MALFORMED, "duplicate member name", id="duplicate"),
    pytest.param(PARSER, DUPLICATE_NESTED, MALFORMED, "duplicate member name", id="dup-nested"),
    pytest.param(PARSER, DUPLICATE_ESCAPED, MALFORMED, "duplicate member name", id="dup-escaped"),
    pytest.param(GATE, DUPLICATE_GRANT, MALFORMED, "duplicate member name", id="dup-grant"),
]


@pytest.mark.parametrize(("node", "patch", "expect", "fragment"), PARSE_CASES)
async def test_malformed_json_is_refused_at_the_parse_step(
    env: Env, thread: str, node: str, patch: bytes, expect: Expect, fragment: str
) -> None:
    error, _ = await env.refused(node, thread, patch, expect)
    assert fragment in error.message, error.message


async def test_nesting_at_the_depth_bound_is_parsed_then_judged_by_the_schema(
    env: Env, thread: str
) -> None:
    patch = b'{"requested_action": ' + b"[" * 31 + b"]" * 31 + b"}"
    await env.refused(PARSER, thread, patch, schema("requested_action"))


# --- the typed policy: booleans, numbers and timestamps, on a service of its own ------------


@pytest_asyncio.fixture(scope="module")
async def typed_env(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger
) -> AsyncIterator[Env]:
    running = await start(
        settings.model_copy(update={"policy_path": TYPED_POLICY}), dsn=database_dsn
    )
    typed_target = f"localhost:{running.port}"
    try:
        async with AsyncExitStack() as stack:
            actors = {
                TYPED_WRITER: await stack.enter_async_context(
                    connected(typed_target, pki, Role.NODE, TYPED_WRITER)
                ),
                "operator": await stack.enter_async_context(
                    connected(typed_target, pki, Role.OPERATOR, "admin")
                ),
            }
            yield Env(ledger, actors)
    finally:
        await running.stop(grace=1.0)


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"flag": "true"}, "flag"),
        ({"flag": "True"}, "flag"),
        ({"flag": 1}, "flag"),
        ({"flag": 0}, "flag"),
        ({"flag": "yes"}, "flag"),
        ({"count": "1"}, "count"),
        ({"count": True}, "count"),
        ({"count": 1.0}, "count"),
        ({"count": 101}, "count"),
        ({"ratio": "0.5"}, "ratio"),
        ({"ratio": True}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"stamp": "2026-01-02 03:04:05"}, "stamp"),
        ({"stamp": "2026-01-02T03:04:05"}, "stamp"),
        ({"stamp": "2026-13-02T03:04:05Z"}, "stamp"),
        ({"stamp": 1767323045}, "stamp"),
        ({"flag": True, "count": "2", "stamp": "yesterday"}, "count,stamp"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else str(value),
)
async def test_no_coercion_of_scalars(typed_env: Env, patch: dict[str, Any], key: str) -> None:
    thread_id = await typed_env.thread(TYPED_INITIAL, policy="typed")
    await typed_env.refused(TYPED_WRITER, thread_id, patch, schema(*key.split(",")))


async def test_typed_values_that_fit_commit(typed_env: Env) -> None:
    thread_id = await typed_env.thread(TYPED_INITIAL, policy="typed")
    patch = {"flag": True, "count": 100, "ratio": 1, "stamp": "2026-01-02T03:04:05.5+01:00"}
    committed = await typed_env[TYPED_WRITER].client.propose(thread_id, 0, patch)
    assert (await typed_env.ledger.record(thread_id, committed.version))["patch"] == patch
    assert await typed_env.state(thread_id) == {**TYPED_INITIAL, **patch}


# --- 3. identity comes from the certificate, never from the request ------------------------


@pytest.mark.parametrize(
    ("patch", "keys"),
    [
        ({"node": WRITER, "result_ref": "db://orders/42"}, ("node", "result_ref")),
        (
            {"node_id": f"spiffe://ztate.test/node/{WRITER}", "requested_action": act("x")},
            ("node_id",),
        ),
        ({"requested_action": act("x"), "approved_by": GATE}, ("approved_by",)),
    ],
    ids=["node-member", "spiffe-id-member", "approver-member"],
)
async def test_a_name_in_the_patch_is_just_an_unwritable_key(
    env: Env, thread: str, patch: dict[str, Any], keys: tuple[str, ...]
) -> None:
    await env.refused(PARSER, thread, patch, not_writable(*keys))


async def test_a_name_inside_a_value_is_a_schema_violation(env: Env, thread: str) -> None:
    patch = {"requested_action": {"action": "refund", "order_id": "A-42", "node": WRITER}}
    await env.refused(PARSER, thread, patch, schema("requested_action"))


@pytest.mark.parametrize(
    "key",
    [WRITER, f"spiffe://ztate.test/node/{WRITER}", f"node/{WRITER}/retry-1"],
)
async def test_an_idempotency_key_naming_another_node_grants_nothing(
    env: Env, thread: str, key: str
) -> None:
    await env.refused(
        PARSER,
        thread,
        {"result_ref": "db://orders/42"},
        not_writable("result_ref"),
        idempotency_key=key,
    )
    committed = await env[PARSER].client.propose(
        thread, 0, {"requested_action": act("x")}, idempotency_key=key
    )
    assert committed.node_id == env[PARSER].spiffe_id
    [_genesis, row] = await env.ledger.rows(thread)
    assert row["node_id"] == env[PARSER].spiffe_id


async def test_replaying_another_nodes_request_does_not_return_its_outcome(
    env: Env, thread: str
) -> None:
    """The db-writer's committed request, replayed byte for byte by the parser, is
    judged as the parser's own: not the writer's transition handed back."""
    writes = {"result_ref": "db://orders/42"}
    done = await env[WRITER].client.propose(thread, 0, writes, idempotency_key="write-1")
    await env.refused(PARSER, thread, writes, not_writable("result_ref"), idempotency_key="write-1")
    error, _ = await env.refused(
        PARSER,
        thread,
        {"requested_action": act("x")},
        Expect(StaleVersion, "STALE_VERSION", grpc.StatusCode.ABORTED),
        idempotency_key="write-1",
    )
    assert error.current_version == done.version == 1


async def test_a_thread_id_naming_another_node_grants_nothing(env: Env) -> None:
    thread_id = await env.thread(INITIAL, thread_id=f"node:{WRITER}:{new_thread_id()}")
    await env.refused(
        PARSER, thread_id, {"result_ref": "db://orders/42"}, not_writable("result_ref")
    )
    committed = await env[PARSER].client.propose(thread_id, 0, {"requested_action": act("x")})
    record = await env.ledger.record(thread_id, committed.version)
    assert record["node_id"] == committed.node_id == env[PARSER].spiffe_id


async def test_metadata_claiming_another_identity_is_ignored(
    env: Env, thread: str, pki: Pki, target: str
) -> None:
    creds = pki.node(PARSER)
    channel_creds = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    metadata = (
        ("x-ztate-node", WRITER),
        ("x-spiffe-id", f"spiffe://ztate.test/node/{WRITER}"),
        ("x-forwarded-client-cert", f"URI=spiffe://ztate.test/node/{WRITER}"),
        ("authorization", f"Bearer {WRITER}"),
    )
    parser = env[PARSER]
    before = await observe(env.ledger, env.operator, parser, thread)
    async with grpc.aio.secure_channel(target, channel_creds) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        refused_request = transition_pb2.ProposeTransitionRequest(
            thread_id=thread,
            expected_version=0,
            patch_json=b'{"result_ref": "db://orders/42"}',
            idempotency_key="claims-db-writer",
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ProposeTransition(refused_request, metadata=metadata, timeout=5)
        after = await observe(env.ledger, env.operator, parser, thread)
        after.assert_unchanged_since(before)
        [row] = after.rejections[len(before.rejections) :]
        assert (row["reason"], row["node_id"]) == ("KEY_NOT_WRITABLE", parser.spiffe_id)
        accepted_request = transition_pb2.ProposeTransitionRequest(
            thread_id=thread,
            expected_version=0,
            patch_json=b'{"requested_action": {"action": "none"}}',
            idempotency_key="claims-db-writer-2",
        )
        response = await stub.ProposeTransition(accepted_request, metadata=metadata, timeout=5)
    error = from_rpc_error(caught.value)
    assert (error.code, error.reason, error.keys) == (
        PERMISSION,
        "KEY_NOT_WRITABLE",
        ("result_ref",),
    )
    assert response.transition.node_id == parser.spiffe_id


# --- 4. core keys are immutable after creation ---------------------------------------------


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize(
    "patch",
    [
        {"authority": {"tenant": "evil"}},
        {"authority": {"tenant": "acme", "acting_for": "root"}},
        {"authority": None},
    ],
    ids=["replace", "extend", "remove"],
)
async def test_no_node_writes_a_core_key(
    env: Env, thread: str, node: str, patch: dict[str, Any]
) -> None:
    await env.refused(node, thread, patch, not_writable("authority"))


async def test_core_key_beside_allowed_keys_refuses_the_whole_patch(env: Env, thread: str) -> None:
    patch = {"pending_transition": plan(), "authority": {"tenant": "evil"}}
    await env.refused(PLANNER, thread, patch, not_writable("authority"))


async def test_an_operator_cannot_propose_at_all(env: Env, thread: str) -> None:
    for patch in ({"authority": {"tenant": "evil"}}, {"requested_action": act("x")}):
        await env.refused("operator", thread, patch, ROLE_FORBIDDEN)


async def test_core_keys_remain_exactly_as_created(env: Env, thread: str) -> None:
    for node in NODES:
        await env.refused(node, thread, {"authority": {"tenant": node}}, not_writable("authority"))
    await env.refused("operator", thread, {"authority": {"tenant": "ops"}}, ROLE_FORBIDDEN)
    # the thread moves on through honest writes; authority never does
    await env[PLANNER].client.propose(thread, 0, {"pending_transition": plan()})
    await env[GATE].client.propose(
        thread, 1, {"approved_action": plan(), "approval_receipt": "r-1"}
    )
    await env[WRITER].client.propose(thread, 2, {"result_ref": "db://orders/A-42"})
    state = await env.state(thread)
    assert state["authority"] == INITIAL["authority"]
    rows = await env.ledger.rows(thread)
    assert len(rows) == 4
    assert all("authority" not in row_patch(r) for r in rows[1:])
    assert await env.ledger.verify(thread) == 4
    planner_view = await env[PLANNER].client.get_view(thread)
    assert planner_view.state["authority"] == INITIAL["authority"]


def row_patch(row: Any) -> dict[str, Any]:
    patch: dict[str, Any] = json.loads(bytes(row["record"]))["patch"]
    return patch


async def test_billing_core_key_is_immutable(env: Env) -> None:
    thread_id = await env.thread(BILLING_INITIAL, policy="billing")
    await env.refused(INVOICER, thread_id, {"customer_id": OTHER_USER}, not_writable("customer_id"))
    assert (await env.state(thread_id))["customer_id"] == CUSTOMER


async def test_characteristics_key_is_immutable(typed_env: Env) -> None:
    thread_id = await typed_env.thread(TYPED_INITIAL, policy="typed")
    for patch in ({"persona": "reckless"}, {"persona": None}, {"flag": True, "persona": "x"}):
        await typed_env.refused(TYPED_WRITER, thread_id, patch, not_writable("persona"))
    assert (await typed_env.state(thread_id))["persona"] == "careful"


# --- 5. a thread is bound to one policy ------------------------------------------------------


@pytest.mark.parametrize(
    "patch",
    [{"invoice_note": "paid"}, {"invoice_total_cents": 0, "invoice_note": "waived"}],
    ids=["note", "total"],
)
async def test_billing_node_cannot_write_a_pipeline_thread(
    env: Env, thread: str, patch: dict[str, Any]
) -> None:
    await env.refused(INVOICER, thread, patch, POLICY_MISMATCH)


async def test_billing_node_cannot_read_a_pipeline_thread(env: Env, thread: str) -> None:
    with pytest.raises(NotFound) as caught:
        await env[INVOICER].client.get_view(thread)
    with pytest.raises(NotFound) as missing:
        await env[INVOICER].client.get_view(new_thread_id())
    assert (caught.value.reason, caught.value.code) == ("THREAD_NOT_FOUND", NOT_FOUND)
    # indistinguishable from a thread that does not exist
    assert caught.value.message.replace(thread, "X") == missing.value.message.replace(
        missing.value.message.split("'")[1], "X"
    )
    assert "acme" not in caught.value.message


async def test_billing_node_using_pipeline_keys_fails_its_own_allowlist_first(
    env: Env, thread: str
) -> None:
    await env.refused(
        INVOICER, thread, {"requested_action": act("x")}, not_writable("requested_action")
    )


@pytest.mark.parametrize(
    ("node", "patch"),
    [
        (PARSER, {"requested_action": act("x")}),
        (PLANNER, {"pending_transition": plan()}),
        (GATE, {"approval_receipt": "r-1"}),
        (WRITER, {"result_ref": "db://invoices/1"}),
    ],
    ids=NODES,
)
async def test_pipeline_node_cannot_touch_a_billing_thread(
    env: Env, node: str, patch: dict[str, Any]
) -> None:
    thread_id = await env.thread(BILLING_INITIAL, policy="billing")
    await env.refused(node, thread_id, patch, POLICY_MISMATCH)
    with pytest.raises(NotFound) as caught:
        await env[node].client.get_view(thread_id)
    assert caught.value.reason == "THREAD_NOT_FOUND"
    assert await env.state(thread_id) == BILLING_INITIAL


async def test_billing_node_works_on_its_own_thread(env: Env) -> None:
    thread_id = await env.thread(BILLING_INITIAL, policy="billing")
    committed = await env[INVOICER].client.propose(thread_id, 0, {"invoice_note": "paid"})
    record = await env.ledger.record(thread_id, committed.version)
    assert record["node_id"] == committed.node_id == env[INVOICER].spiffe_id
    view = await env[INVOICER].client.get_view(thread_id)
    assert view.state == {"invoice_total_cents": 1200, "invoice_note": "paid"}


# --- 6. CEL invariants on the candidate state ----------------------------------------------


@pytest.mark.parametrize(
    ("approved", "rules"),
    [
        ({**plan(), "order_id": "B-99"}, ("approval-follows-the-plan",)),
        ({**plan(), "action": "cancel_order"}, ("approval-follows-the-plan",)),
        (plan(amount=None), ("refunds-carry-an-amount",)),
        (
            plan(order_id="B-99", amount=None),
            ("approval-follows-the-plan", "refunds-carry-an-amount"),
        ),
    ],
    ids=["other-order", "other-action", "refund-without-amount", "both"],
)
async def test_invariant_violations_are_refused(
    env: Env, planned: str, approved: dict[str, Any], rules: tuple[str, ...]
) -> None:
    error, row = await env.refused(
        GATE, planned, {"approved_action": approved}, invariant(*rules), version=1
    )
    assert rules[0] in error.message
    assert "B-99" not in row["message"]


async def test_approval_without_a_plan_is_refused(env: Env, thread: str) -> None:
    await env.refused(
        GATE, thread, {"approved_action": plan()}, invariant("approval-follows-the-plan")
    )


async def test_invariant_holding_commits(env: Env, planned: str) -> None:
    committed = await env[GATE].client.propose(planned, 1, {"approved_action": plan()})
    assert committed.version == 2
    assert (await env.state(planned))["approved_action"] == plan()


# --- 7. secrets never enter state ------------------------------------------------------------

PEM_BLOCK = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n"
    "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n"
    "-----END RSA PRIVATE KEY-----"
)
# Assembled at run time, so the file itself never carries the classic shapes.
AWS_ACCESS_KEY_ID = "AKIA" + "J7QX2LMNP4RT6VWZ"
RANDOM_TOKEN = "TVT8FNRqtAKduf2rXe/iUlznAEGxKom+hJmaCwby"  # 30 random bytes, base64
DOCUMENTED_FORMATS = {
    "github-token": "ghp" + "_" + "R7fK2mQ9xL4vT8nB3cW6yP1dZ5hJ0sA2gE4u",
    "stripe-live-key": "sk" + "_live_" + "51Hx9QmK2LpT8vW3rY6nB4cD",
    "jwt": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
    + ".eyJzdWIiOiJkYi13cml0ZXIiLCJyb2xlIjoiYWRtaW4ifQ"
    + ".Qm9n3vK8xT2pL5rW7yZ1cA4dF6hJ9kM0nP3sU5wX8zE",
    "url-with-password": "postgres://admin:" + "Tr0ub4dor-Horse-9@db.internal:5432/orders",
    "slack-webhook": "https://hooks.slack.com/services/"
    + "T024BE7LD/B01F5KXGH8V/"
    + "q3ZP7mW9xK2vL8nR4tY6cB1d",
    "bearer-header": "Authorization: Bearer " + "b3JkZXJzOnJlZnVuZDpzZWNyZXQtOTk4NzY1",
}
CREDENTIALS = {
    "pem-private-key": PEM_BLOCK,
    "aws-access-key-id": AWS_ACCESS_KEY_ID,
    "aws-access-key-id-in-prose": f"customer pasted {AWS_ACCESS_KEY_ID} into the chat",
    "high-entropy-token": RANDOM_TOKEN,
    **DOCUMENTED_FORMATS,
}


@pytest.mark.parametrize("secret", list(CREDENTIALS.values()), ids=list(CREDENTIALS))
async def test_credential_in_a_string_value_is_refused(env: Env, thread: str, secret: str) -> None:
    patch = {"pending_transition": {**plan(), "reason": secret}}
    error, row = await env.refused(PLANNER, thread, patch, credential("pending_transition"))
    assert_secret_absent(secret, error.message, row)


def assert_secret_absent(secret: str, message: str, row: Any) -> None:
    fragments = {secret, *(line for line in secret.splitlines() if len(line) > 8)}
    for fragment in fragments:
        assert fragment not in message
        for column, value in dict(row).items():
            assert fragment not in str(value), column


@pytest.mark.parametrize(
    "secret",
    [PEM_BLOCK, AWS_ACCESS_KEY_ID, f"receipt for {AWS_ACCESS_KEY_ID}"],
    ids=["pem-private-key", "aws-access-key-id", "aws-access-key-id-in-prose"],
)
async def test_opaque_keys_still_refuse_well_known_credential_formats(
    env: Env, thread: str, secret: str
) -> None:
    error, row = await env.refused(
        GATE, thread, {"approval_receipt": secret}, credential("approval_receipt")
    )
    assert_secret_absent(secret, error.message, row)


async def test_credential_in_a_url_is_refused(env: Env, thread: str) -> None:
    ref = f"https://{AWS_ACCESS_KEY_ID}/orders/42"
    error, row = await env.refused(WRITER, thread, {"result_ref": ref}, credential("result_ref"))
    assert_secret_absent(AWS_ACCESS_KEY_ID, error.message, row)


async def test_random_token_in_an_opaque_key_is_accepted(env: Env, thread: str) -> None:
    committed = await env[GATE].client.propose(thread, 0, {"approval_receipt": RANDOM_TOKEN})
    record = await env.ledger.record(thread, committed.version)
    assert record["patch"] == {"approval_receipt": RANDOM_TOKEN}
    assert (await env[WRITER].client.get_view(thread)).state["approval_receipt"] == RANDOM_TOKEN


async def test_low_entropy_prose_is_not_a_credential(env: Env, thread: str) -> None:
    reason = "customer says the parcel arrived damaged and asks for a refund of order A-42"
    await env[PLANNER].client.propose(
        thread, 0, {"pending_transition": {**plan(), "reason": reason}}
    )
    assert (await env.state(thread))["pending_transition"]["reason"] == reason


# --- 8. risky changes are parked, not committed ---------------------------------------------


async def test_target_user_change_is_parked(env: Env, thread: str) -> None:
    patch = {"target_user_id": OTHER_USER}
    waiting, _row = await env.parked(
        PLANNER, thread, patch, ("target-user-change",), idempotency_key="switch-user"
    )
    assert (await env.state(thread))["target_user_id"] == USER
    # a retry is the same parked transition, not a second one
    with pytest.raises(AwaitingApproval) as again:
        await env[PLANNER].client.propose(thread, 0, patch, idempotency_key="switch-user")
    assert again.value.handle == waiting.handle  # the same parked proposal, replayed
    assert [r["digest"] for r in await pending_rows(env.ledger.dsn, thread)] == [waiting.digest]
    # the same key for another request is refused, and parks nothing
    await env.refused(
        PLANNER,
        thread,
        {"target_user_id": "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"},
        KEY_REUSED,
        idempotency_key="switch-user",
    )
    assert [r["digest"] for r in await pending_rows(env.ledger.dsn, thread)] == [waiting.digest]
    assert (await env.ledger.snapshot(thread)).head_version == 0


async def test_retry_of_a_parked_request_after_the_head_moved(env: Env, thread: str) -> None:
    patch = {"target_user_id": OTHER_USER}
    waiting, _ = await env.parked(
        PLANNER, thread, patch, ("target-user-change",), idempotency_key="k1"
    )
    await env[PARSER].client.propose(thread, 0, {"requested_action": act("x")})
    with pytest.raises(AwaitingApproval) as again:
        await env[PLANNER].client.propose(thread, 0, patch, idempotency_key="k1")
    assert (again.value.handle, again.value.base_version) == (waiting.handle, 0)
    assert len(await pending_rows(env.ledger.dsn, thread)) == 1


async def test_parked_key_cannot_be_reused_for_a_harmless_patch(env: Env, thread: str) -> None:
    """One idempotency key names one request: once a request is parked under it, a
    different request under the same key is refused, whether or not it is risky."""
    await env.parked(
        PLANNER,
        thread,
        {"target_user_id": OTHER_USER},
        ("target-user-change",),
        idempotency_key="k2",
    )
    await env.refused(
        PLANNER, thread, {"pending_transition": plan()}, KEY_REUSED, idempotency_key="k2"
    )


async def test_committed_key_cannot_be_reused_for_a_risky_patch(env: Env, thread: str) -> None:
    await env[PLANNER].client.propose(
        thread, 0, {"pending_transition": plan()}, idempotency_key="k3"
    )
    await env.refused(
        PLANNER, thread, {"target_user_id": OTHER_USER}, KEY_REUSED, version=1, idempotency_key="k3"
    )
    assert await pending_rows(env.ledger.dsn, thread) == []


async def test_unchanged_target_user_is_not_risky(env: Env, thread: str) -> None:
    committed = await env[PLANNER].client.propose(thread, 0, {"target_user_id": USER})
    assert committed.version == 1
    assert await pending_rows(env.ledger.dsn, thread) == []


PERMITTED = ["read_orders", "refund"]


@pytest_asyncio.fixture
async def permitted(env: Env) -> str:
    return await env.thread({**INITIAL, "execution_permissions": PERMITTED})


@pytest.mark.parametrize(
    "widened",
    [["read_orders", "refund", "cancel_order"], ["update_address"], ["refund", "cancel_order"]],
    ids=["superset", "disjoint", "swap"],
)
async def test_widening_permissions_is_parked(env: Env, permitted: str, widened: list[str]) -> None:
    await env.parked(GATE, permitted, {"execution_permissions": widened}, ("permissions-widening",))
    assert (await env.state(permitted))["execution_permissions"] == PERMITTED


async def test_granting_first_permissions_is_parked(env: Env, thread: str) -> None:
    await env.parked(
        GATE, thread, {"execution_permissions": ["read_orders"]}, ("permissions-widening",)
    )
    assert "execution_permissions" not in await env.state(thread)


@pytest.mark.parametrize(
    "narrowed",
    [["read_orders"], [], ["refund", "read_orders"], PERMITTED],
    ids=["subset", "empty", "reordered", "unchanged"],
)
async def test_narrowing_permissions_commits_without_approval(
    env: Env, permitted: str, narrowed: list[str]
) -> None:
    committed = await env[GATE].client.propose(permitted, 0, {"execution_permissions": narrowed})
    assert committed.version == 1
    assert (await env.state(permitted))["execution_permissions"] == narrowed
    assert await pending_rows(env.ledger.dsn, permitted) == []


async def test_large_refund_is_parked(env: Env) -> None:
    thread_id = await env.thread(INITIAL)
    big = plan(amount=60_000)
    await env[PLANNER].client.propose(thread_id, 0, {"pending_transition": big})
    _waiting, row = await env.parked(
        GATE,
        thread_id,
        {"approved_action": big, "approval_receipt": "r-1"},
        ("large-refund",),
        version=1,
    )
    assert_digest(row["parent_digest"])
    assert "approved_action" not in await env.state(thread_id)


async def test_refund_at_the_threshold_commits(env: Env) -> None:
    thread_id = await env.thread(INITIAL)
    edge = plan(amount=50_000)
    await env[PLANNER].client.propose(thread_id, 0, {"pending_transition": edge})
    committed = await env[GATE].client.propose(thread_id, 1, {"approved_action": edge})
    assert committed.version == 2


async def test_several_rules_match_at_once(env: Env, permitted: str) -> None:
    big = plan(amount=75_000)
    await env[PLANNER].client.propose(permitted, 0, {"pending_transition": big})
    patch = {"approved_action": big, "execution_permissions": [*PERMITTED, "cancel_order"]}
    await env.parked(GATE, permitted, patch, ("large-refund", "permissions-widening"), version=1)


async def test_parked_proposal_on_the_wire_names_no_digest_to_an_unmarked_node(
    env: Env, thread: str
) -> None:
    """The planner (not read_records) is told it was parked and how to wait, nothing
    that commits to state it may not read; the stored proposal hashes to its digest."""
    stub = env[PLANNER].client._stub  # the SDK keeps proposal_json to itself
    request = transition_pb2.ProposeTransitionRequest(
        thread_id=thread,
        expected_version=0,
        patch_json=wire({"target_user_id": OTHER_USER}),
        idempotency_key="wire-1",
    )
    response = await stub.ProposeTransition(request)
    assert response.WhichOneof("outcome") == "pending"
    pending = response.pending
    assert (pending.digest, pending.proposal_json, list(pending.risk_rules)) == ("", b"", [])
    assert pending.handle == f"{thread}/wire-1"
    [row] = await pending_rows(env.ledger.dsn, thread)
    assert hashlib.sha256(bytes(row["proposal"])).hexdigest() == row["digest"]
