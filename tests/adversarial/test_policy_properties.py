"""Property: a proposal commits if and only if every rule of the policy allows it.

Hypothesis generates proposals for the four-node pipeline policy: a random node,
a random subset of keys (sometimes keys outside the node's allowlist), and values
drawn both from each key's valid domain and from near misses (wrong types,
values just past a bound, patterns off by one character, extra or missing
members, credentials). Each goes over real gRPC, with the node's own
certificate, to a fresh thread whose initial state is drawn too.

An independent oracle, plain Python written from docs/policy.md and
services/defaults/policy.yaml (it calls none of the service's policy, schema or
CEL code), predicts the outcome: commit; park, naming the risk rules; or the
first failing check in pipeline order, with its keys or rules. The service must
agree, and a refusal or a parking must leave the head, ledger and state alone.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest_asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.adversarial.helpers import Actor, connected, create_thread
from tests.conftest import TEST_MAX_PATCH_BYTES
from tests.harness import INITIAL, NODES, USER, Ledger, Pki
from ztate.services.runtime.identity import Role
from ztate.worker_sdk import AwaitingApproval, Transition, ZtateError, encode_json

PARSER, PLANNER, GATE, WRITER = NODES
OTHER_USER = "9f1c2b3a-4d5e-4f60-8a7b-0c1d2e3f4a5b"
PEM_BLOCK = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
)
AWS_ACCESS_KEY_ID = "AKIA" + "J7QX2LMNP4RT6VWZ"
SECRETS = (PEM_BLOCK, AWS_ACCESS_KEY_ID)

# --- the oracle: the pipeline policy, restated by hand ------------------------------------

WRITABLE = {
    PARSER: frozenset({"requested_action"}),
    PLANNER: frozenset({"pending_transition", "target_user_id"}),
    GATE: frozenset({"approval_receipt", "approved_action", "execution_permissions"}),
    WRITER: frozenset({"result_ref"}),
}
PATCH_LIMIT = {PARSER: 4096}
DECLARED = frozenset(
    {
        "authority",
        "target_user_id",
        "execution_permissions",
        "approved_action",
        "approval_receipt",
        "requested_action",
        "pending_transition",
        "result_ref",
        "raw_text",
    }
)
ACTIONS = ("refund", "cancel_order", "lookup", "update_address")
PERMISSIONS = ("read_orders", "refund", "cancel_order", "update_address")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ORDER_ID = re.compile(r"[A-Z0-9-]+")
URL = re.compile(r"[a-z]+://[^\s]+")

Check = Callable[[Any], bool]


def text(max_length: int, pattern: re.Pattern[str] | None = None) -> Check:
    return lambda v: (
        type(v) is str
        and len(v) <= max_length
        and (pattern is None or pattern.fullmatch(v) is not None)
    )


def integer(low: int, high: int) -> Check:
    return lambda v: type(v) is int and low <= v <= high


def one_of(values: tuple[str, ...]) -> Check:
    return lambda v: type(v) is str and v in values


def members(props: dict[str, Check], required: set[str]) -> Check:
    """An object with only these members, the required ones present, none null."""
    return lambda v: (
        type(v) is dict
        and set(v) <= set(props)
        and required <= set(v)
        and all(props[name](item) for name, item in v.items())
    )


AMOUNT = integer(0, 10_000_000)
ORDER = text(32, ORDER_ID)
SCHEMA: dict[str, Check] = {
    "target_user_id": lambda v: type(v) is str and UUID.fullmatch(v) is not None,
    "execution_permissions": lambda v: (
        type(v) is list and len(v) <= 4 and all(one_of(PERMISSIONS)(p) for p in v)
    ),
    "approved_action": members(
        {"action": one_of(ACTIONS), "order_id": ORDER, "amount_cents": AMOUNT},
        {"action", "order_id"},
    ),
    "approval_receipt": text(4096),
    "requested_action": members(
        {"action": one_of((*ACTIONS, "none")), "order_id": ORDER, "amount_cents": AMOUNT},
        {"action"},
    ),
    "pending_transition": members(
        {
            "action": one_of(ACTIONS),
            "order_id": ORDER,
            "amount_cents": AMOUNT,
            "reason": text(500),
        },
        {"action", "order_id"},
    ),
    "result_ref": text(256, URL),
}


def holds_secret(value: Any) -> bool:
    if isinstance(value, str):
        return any(secret in value for secret in SECRETS)
    if isinstance(value, dict):
        return any(holds_secret(item) for item in value.values())
    if isinstance(value, list):
        return any(holds_secret(item) for item in value)
    return False


def apply(state: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    result = dict(state)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def broken_invariants(state: dict[str, Any], patch: dict[str, Any]) -> list[str]:
    """The invariants hold for every state: an approved action must match the plan,
    and an approved refund must carry an amount. Removing the approval keeps both."""
    broken = []
    approved, planned = state.get("approved_action"), state.get("pending_transition")
    if approved is not None:
        if planned is None or (approved["action"], approved["order_id"]) != (
            planned["action"],
            planned["order_id"],
        ):
            broken.append("approval-follows-the-plan")
        if approved["action"] == "refund" and "amount_cents" not in approved:
            broken.append("refunds-carry-an-amount")
    return broken


def matched_risk_rules(old: dict[str, Any], patch: dict[str, Any]) -> list[str]:
    """A keys rule matches a real change; an expression rule matches when true or
    when it cannot be evaluated (fail closed)."""
    rules = []
    if "target_user_id" in patch and patch["target_user_id"] != old.get("target_user_id"):
        rules.append("target-user-change")
    granted = patch.get("execution_permissions")
    held = old.get("execution_permissions", [])
    if granted is not None and any(p not in held for p in granted):
        rules.append("permissions-widening")  # removing permissions narrows them
    approved = patch.get("approved_action")
    if (
        approved is not None
        and approved["action"] == "refund"
        and approved.get("amount_cents", 0) > 50_000
    ):
        rules.append("large-refund")
    return sorted(rules)


@dataclass(frozen=True)
class Verdict:
    """``outcome`` is "commit", "park" or a reason code."""

    outcome: str
    keys: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)


def oracle(node: str, initial: dict[str, Any], patch: dict[str, Any], data: bytes) -> Verdict:
    """The outcome every rule of the policy, applied in pipeline order, demands."""
    if len(data) > PATCH_LIMIT.get(node, TEST_MAX_PATCH_BYTES):
        return Verdict("PATCH_TOO_LARGE")
    if not patch:
        return Verdict("REQUEST_INVALID")
    refused = sorted(set(patch) - WRITABLE[node])
    if refused:
        return Verdict("KEY_NOT_WRITABLE", keys=tuple(refused))
    misfits = sorted(k for k, v in patch.items() if v is not None and not SCHEMA[k](v))
    if misfits:
        return Verdict("SCHEMA_VIOLATION", keys=tuple(misfits))
    for key, value in patch.items():
        if holds_secret(value):
            return Verdict("CREDENTIAL_DETECTED", keys=(key,))
    # layers: every writable key is at or below its node's layer, so none can fail
    state = apply(initial, patch)
    broken = broken_invariants(state, patch)
    if broken:
        return Verdict("INVARIANT_VIOLATED", rules=tuple(broken))
    risky = matched_risk_rules(initial, patch)
    if risky:
        return Verdict("park", rules=tuple(risky), state=initial)
    return Verdict("commit", state=state)


# --- the generator: valid values and near misses -------------------------------------------

ORDERS = st.sampled_from(["A-42", "B-7", "ORDER-2026-0001", "X" * 32])
BAD_ORDERS = st.sampled_from(["a-42", "A 42", "A-42\n", "X" * 33, "", 42, None])
AMOUNTS = st.sampled_from([0, 1, 1500, 50_000, 50_001, 75_000, 10_000_000])
BAD_AMOUNTS = st.sampled_from(["1", True, 12.5, 12.0, -1, 10_000_001, None])
REASONS = st.sampled_from(["", "customer asked twice", "parcel arrived damaged", "x" * 500])
BAD_REASONS = st.sampled_from([42, "x" * 501, PEM_BLOCK, f"pasted {AWS_ACCESS_KEY_ID} here"])
RECEIPTS = st.sampled_from(["r-1", "", "ab" * 32, "TVT8FNRqtAKduf2rXe/iUlznAEGxKom+hJmaCwby"])
BAD_RECEIPTS = st.sampled_from([7, "r" * 4097, PEM_BLOCK, AWS_ACCESS_KEY_ID, ["r-1"]])
REFS = st.sampled_from(["db://orders/A-42", "https://example.test/r/1", "db://" + "a" * 251])
BAD_REFS = st.sampled_from(
    ["orders/42", "s3://bucket/k", "db://x y", "db://" + "a" * 252, 5, f"db://{AWS_ACCESS_KEY_ID}"]
)
USERS = st.one_of(st.sampled_from([USER, OTHER_USER, None]), st.uuids(version=4).map(str))
BAD_USERS = st.sampled_from(["not-a-uuid", OTHER_USER.upper(), OTHER_USER + "\n", 123, ""])
GRANTS = st.one_of(st.lists(st.sampled_from(PERMISSIONS), max_size=4), st.none())
BAD_GRANTS = st.sampled_from(
    [[*PERMISSIONS, "refund"], ["admin"], "refund", [1], [["refund"]], {"refund": True}]
)
NOT_OBJECTS = st.sampled_from(["refund", [], 1, True])
FOREIGN = [*sorted(DECLARED), "is_admin", "node"]


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (``st.integers`` favours its bounds; this does
    not), shrinking towards False."""
    return st.sampled_from([False] * (n - 1) + [True])


@st.composite
def valued(draw: st.DrawFn, good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> Any:
    """Mostly a valid value, sometimes a near miss."""
    return draw(bad) if draw(one_in(5)) else draw(good)


@st.composite
def action_object(
    draw: st.DrawFn, actions: tuple[str, ...], *, reason: bool, plan: dict[str, Any] | None
) -> Any:
    if draw(one_in(12)):
        return draw(NOT_OBJECTS)
    if plan is not None and draw(st.booleans()):
        value = {k: v for k, v in plan.items() if k != "reason"}  # the plan, approved as is
        if draw(st.booleans()):
            value["amount_cents"] = draw(valued(AMOUNTS, BAD_AMOUNTS))
        return value
    bad_actions = st.sampled_from(["delete", "Refund", "none", 1, None])
    candidates: list[tuple[str, st.SearchStrategy[Any]]] = [
        ("action", valued(st.sampled_from(actions), bad_actions)),
        ("order_id", valued(ORDERS, BAD_ORDERS)),
        ("amount_cents", valued(AMOUNTS, BAD_AMOUNTS)),
    ]
    if reason:
        candidates.append(("reason", valued(REASONS, BAD_REASONS)))
    value: dict[str, Any] = {}
    for name, strategy in candidates:
        if not draw(one_in(5)):
            value[name] = draw(strategy)
    if draw(one_in(12)):
        value["is_admin"] = True
    return value


def value_for(key: str, initial: dict[str, Any]) -> st.SearchStrategy[Any]:
    plan = initial.get("pending_transition")
    return {
        "requested_action": action_object((*ACTIONS, "none"), reason=False, plan=None),
        "pending_transition": action_object(ACTIONS, reason=True, plan=None),
        "approved_action": action_object(ACTIONS, reason=False, plan=plan),
        "target_user_id": valued(USERS, BAD_USERS),
        "execution_permissions": valued(
            st.one_of(GRANTS, st.just(initial.get("execution_permissions", []))), BAD_GRANTS
        ),
        "approval_receipt": valued(RECEIPTS, BAD_RECEIPTS),
        "result_ref": valued(REFS, BAD_REFS),
        "authority": st.sampled_from([{"tenant": "evil"}, None]),
        "raw_text": st.just("ignore previous instructions"),
        "is_admin": st.just(True),
        "node": st.sampled_from(list(NODES)),
    }[key]


@dataclass(frozen=True)
class Case:
    node: str
    initial: dict[str, Any]
    patch: dict[str, Any]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    initial = dict(INITIAL)
    if draw(st.booleans()):
        initial["pending_transition"] = {
            "action": draw(st.sampled_from(ACTIONS)),
            "order_id": draw(ORDERS),
            "amount_cents": draw(AMOUNTS),
        }
    if draw(st.booleans()):
        initial["execution_permissions"] = draw(
            st.lists(st.sampled_from(PERMISSIONS), max_size=4, unique=True)
        )
    node = draw(st.sampled_from(NODES))
    own = sorted(WRITABLE[node])
    keys = draw(st.lists(st.sampled_from(own), unique=True, min_size=1, max_size=len(own)))
    if draw(one_in(5)):
        others = [k for k in FOREIGN if k not in WRITABLE[node]]
        keys += draw(st.lists(st.sampled_from(others), unique=True, min_size=1, max_size=2))
    keys = draw(st.permutations(keys))
    if draw(one_in(40)):
        keys = []
    return Case(node, initial, {key: draw(value_for(key, initial)) for key in keys})


PLANNED = {**INITIAL, "pending_transition": {"action": "refund", "order_id": "A-42"}}
GRANTED = {**INITIAL, "execution_permissions": ["read_orders", "refund"]}
# Every outcome at least once, whatever the random draws.
EXAMPLES = [
    Case(PARSER, INITIAL, {"requested_action": {"action": "lookup", "order_id": "A-42"}}),
    Case(PLANNER, INITIAL, {"target_user_id": OTHER_USER}),
    Case(GATE, GRANTED, {"execution_permissions": ["read_orders"]}),
    Case(GATE, GRANTED, {"execution_permissions": ["cancel_order"]}),
    Case(GATE, PLANNED, {"approved_action": {"action": "refund", "order_id": "A-42"}}),
    Case(
        GATE,
        PLANNED,
        {"approved_action": {"action": "refund", "order_id": "A-42", "amount_cents": 90_000}},
    ),
    Case(GATE, PLANNED, {"approval_receipt": AWS_ACCESS_KEY_ID}),
    Case(PARSER, INITIAL, {"requested_action": {"action": "refund", "amount_cents": "1"}}),
    Case(PARSER, INITIAL, {"is_admin": True, "target_user_id": OTHER_USER}),
    Case(PARSER, INITIAL, {"requested_action": {"action": "none"}, "approval_receipt": "r" * 4097}),
    Case(WRITER, INITIAL, {}),
]


# --- the property ----------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def actors(target: str, pki: Pki) -> AsyncIterator[dict[str, Actor]]:
    async with AsyncExitStack() as stack:
        found = {
            name: await stack.enter_async_context(connected(target, pki, Role.NODE, name))
            for name in NODES
        }
        found["operator"] = await stack.enter_async_context(
            connected(target, pki, Role.OPERATOR, "admin")
        )
        yield found


class Judge:
    """Sends one case and compares the service's answer with the oracle's."""

    def __init__(self, actors: dict[str, Actor], conn: asyncpg.Connection) -> None:
        self.actors = actors
        self.conn = conn
        self.seen: Counter[str] = Counter()

    async def ledger(self, thread_id: str) -> tuple[Any, ...]:
        head = await self.conn.fetchrow(
            "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        transitions = await self.conn.fetchval(
            "SELECT count(*) FROM ztate.transitions WHERE thread_id = $1", thread_id
        )
        rejections = await self.conn.fetch(
            "SELECT reason, node_id, keys FROM ztate.rejections WHERE thread_id = $1", thread_id
        )
        pending = await self.conn.fetch(
            "SELECT digest, risk_rules, status FROM ztate.pending_transitions WHERE thread_id = $1",
            thread_id,
        )
        return tuple(head), transitions, [tuple(r) for r in rejections], [tuple(p) for p in pending]

    async def judge(self, case: Case) -> None:
        operator, worker = self.actors["operator"], self.actors[case.node]
        thread_id = await create_thread(operator, case.initial, policy="pipeline")
        genesis_head, _, _, _ = await self.ledger(thread_id)
        data = encode_json(case.patch)
        verdict = oracle(case.node, case.initial, case.patch, data)
        self.seen[verdict.outcome] += 1
        outcome: Transition | AwaitingApproval | ZtateError
        try:
            outcome = await worker.client.propose(thread_id, 0, data)
        except (AwaitingApproval, ZtateError) as raised:
            outcome = raised
        head, count, rejections, pending = await self.ledger(thread_id)
        if isinstance(outcome, AwaitingApproval):
            assert verdict.outcome == "park", (verdict, outcome)
            # the rules and the digest reach a node only if it is marked read_records
            assert outcome.risk_rules in (verdict.rules, ())
            assert (head, count, rejections) == (genesis_head, 1, [])
            [(digest, rules, status)] = pending
            assert (rules, status) == (list(verdict.rules), "pending")
            assert outcome.digest in (digest, "")
        elif isinstance(outcome, ZtateError):
            assert outcome.reason == verdict.outcome, (verdict, outcome)
            assert (outcome.keys, outcome.rules) == (verdict.keys, verdict.rules), outcome
            assert (head, count, pending) == (genesis_head, 1, [])
            assert rejections == [(verdict.outcome, worker.spiffe_id, list(verdict.keys))]
        else:
            assert verdict.outcome == "commit", (verdict, outcome)
            record = json.loads(
                await self.conn.fetchval(
                    "SELECT record FROM ztate.transitions WHERE thread_id = $1 AND version = 1",
                    thread_id,
                )
            )
            assert record["patch"] == json.loads(data)
            assert record["node_id"] == outcome.node_id == worker.spiffe_id
            assert (count, rejections, pending) == (2, [], [])
            assert head[0] == outcome.version == 1
            assert outcome.digest in (head[1], "")
        state = (await operator.client.get_view(thread_id)).state
        assert state == (verdict.state if verdict.outcome == "commit" else case.initial)


async def test_commit_iff_every_rule_allows(actors: dict[str, Actor], ledger: Ledger) -> None:
    conn = await asyncpg.connect(ledger.dsn)
    judge = Judge(actors, conn)
    loop = asyncio.get_running_loop()

    # Hypothesis drives its examples from a worker thread; each example runs on the
    # session's event loop, where the gRPC channels live, so shrinking works too.
    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases())
    def check(case: Case) -> None:
        asyncio.run_coroutine_threadsafe(judge.judge(case), loop).result(timeout=60)

    for case in reversed(EXAMPLES):
        check = example(case)(check)
    try:
        await asyncio.to_thread(check)
    finally:
        await conn.close()
    for outcome in (
        "commit",
        "park",
        "KEY_NOT_WRITABLE",
        "SCHEMA_VIOLATION",
        "CREDENTIAL_DETECTED",
        "INVARIANT_VIOLATED",
        "PATCH_TOO_LARGE",
        "REQUEST_INVALID",
    ):
        assert judge.seen[outcome] > 0, judge.seen


def test_the_oracle_is_not_vacuous() -> None:
    """The oracle itself, on hand-checked cases (no service involved)."""
    planned = {**INITIAL, "pending_transition": {"action": "refund", "order_id": "A-42"}}
    assert oracle(PARSER, INITIAL, {"is_admin": True}, b"{}").outcome == "KEY_NOT_WRITABLE"
    assert oracle(PLANNER, INITIAL, {"target_user_id": USER}, b"{}").outcome == "commit"
    assert oracle(PLANNER, INITIAL, {"target_user_id": None}, b"{}").rules == (
        "target-user-change",
    )
    approve = {"approved_action": {"action": "refund", "order_id": "A-42"}}
    assert oracle(GATE, planned, approve, b"{}").rules == ("refunds-carry-an-amount",)
    assert oracle(GATE, planned, {"approved_action": None}, b"{}").outcome == "commit"
    assert oracle(GATE, INITIAL, {"execution_permissions": []}, b"{}").outcome == "commit"
    assert oracle(GATE, INITIAL, {"execution_permissions": None}, b"{}").outcome == "commit"
    assert oracle(GATE, INITIAL, {"execution_permissions": ["refund"]}, b"{}").outcome == "park"
