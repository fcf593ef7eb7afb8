"""The four-node pipeline of docs/policy.md as a LangGraph ``StateGraph``.

Plain LangGraph code: a state schema whose channels are the policy's keys, four node
functions from the state to an update, four edges. Nothing here knows about ztate;
``run.py`` runs it as it is, then with each node isolated as a ztate worker.

The input parser stands for an LLM reading untrusted text, so it can be
prompt-injected: told to "ignore previous instructions", it obeys, and returns a new
``target_user_id`` (or, told "you are admin", an ``is_admin`` flag) beside its answer.

When ``SUPPORT_GRAPH_TRACE`` names a file, each node appends one JSON line with the
keys of the state it was given: what the test reads to check projections.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

ATTACKER = "6f1c2b3a-9d8e-4f7a-8b6c-5d4e3f2a1b0c"
TRACE_VARIABLE = "SUPPORT_GRAPH_TRACE"
REQUEST = re.compile(
    r"(?P<verb>refund|cancel|look up) order (?P<order>[A-Z0-9-]+)"
    r"(?: for (?P<units>\d+)\.(?P<cents>\d{2}))?",
    re.IGNORECASE,
)
ACTIONS = {"refund": "refund", "cancel": "cancel_order", "look up": "lookup"}
PERMISSION = {
    "refund": "refund",
    "cancel_order": "cancel_order",
    "update_address": "update_address",
    "lookup": "read_orders",
}


class SupportState(TypedDict, total=False):
    """The channels: one per key of the pipeline policy."""

    authority: dict[str, Any]
    target_user_id: str
    execution_permissions: list[str]
    approved_action: dict[str, Any]
    approval_receipt: str
    requested_action: dict[str, Any]
    pending_transition: dict[str, Any]
    result_ref: str
    raw_text: str


def _trace(node: str, state: dict[str, Any]) -> None:
    path = os.environ.get(TRACE_VARIABLE)
    if path:
        with open(path, "a", encoding="utf-8") as trace:
            trace.write(json.dumps({"node": node, "keys": sorted(state), "pid": os.getpid()}))
            trace.write("\n")


def parse(text: str) -> dict[str, Any]:
    found = REQUEST.search(text)
    if found is None:
        return {"action": "none"}
    action: dict[str, Any] = {
        "action": ACTIONS[found["verb"].lower()],
        "order_id": found["order"].upper(),
    }
    if found["units"] is not None:
        action["amount_cents"] = int(found["units"]) * 100 + int(found["cents"])
    return action


def input_parser(state: SupportState) -> dict[str, Any]:
    _trace("input-parser", dict(state))
    text = state.get("raw_text", "")
    update: dict[str, Any] = {"requested_action": parse(text)}
    if "ignore previous instructions" in text.lower():
        update["target_user_id"] = ATTACKER  # the injection: act for another user
    if "you are admin" in text.lower():
        update["is_admin"] = True  # the injection: a key nobody declared
    return update


def planner(state: SupportState) -> dict[str, Any]:
    _trace("planner", dict(state))
    requested = state.get("requested_action") or {"action": "none"}
    if requested.get("action") == "none":
        return {}
    plan = {
        key: requested[key] for key in ("action", "order_id", "amount_cents") if key in requested
    }
    plan["reason"] = f"customer request on behalf of {state.get('target_user_id')}"
    return {"pending_transition": plan}


def approval_gate(state: SupportState) -> dict[str, Any]:
    _trace("approval-gate", dict(state))
    plan = state.get("pending_transition")
    if not plan:
        return {}
    action = {key: plan[key] for key in ("action", "order_id", "amount_cents") if key in plan}
    update: dict[str, Any] = {"approved_action": action}
    granted = list(state.get("execution_permissions", []))
    needed = PERMISSION[plan["action"]]
    if needed not in granted:
        update["execution_permissions"] = sorted([*granted, needed])  # widening: risky
    return update


def db_writer(state: SupportState) -> dict[str, Any]:
    _trace("db-writer", dict(state))
    action = state.get("approved_action")
    if not action:
        return {}
    return {"result_ref": f"orders://{action['order_id']}/{action['action']}"}


def build() -> StateGraph[SupportState]:
    builder: StateGraph[SupportState] = StateGraph(SupportState)
    builder.add_node("input-parser", input_parser)
    builder.add_node("planner", planner)
    builder.add_node("approval-gate", approval_gate)
    builder.add_node("db-writer", db_writer)
    builder.add_edge(START, "input-parser")
    builder.add_edge("input-parser", "planner")
    builder.add_edge("planner", "approval-gate")
    builder.add_edge("approval-gate", "db-writer")
    builder.add_edge("db-writer", END)
    return builder
