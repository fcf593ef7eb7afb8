"""The approval gate: approves the plan and grants the permission it needs.

Widening ``execution_permissions`` or a refund above 500.00 matches a risk rule of
the policy: the change is parked until a human reviewer approves it, and the
gate waits for that outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _node import main

from ztate.worker_sdk import Handler, View, ZtateClient

PERMISSION = {
    "refund": "refund",
    "cancel_order": "cancel_order",
    "update_address": "update_address",
    "lookup": "read_orders",
}


def make_handler(_client: ZtateClient, _thread_id: str, _report: Callable[..., None]) -> Handler:
    approved: list[Any] = []

    def handle(view: View) -> dict[str, Any] | None:
        plan = view.state.get("pending_transition")
        if not plan or plan in approved:
            return None
        approved.append(plan)
        action = {key: plan[key] for key in ("action", "order_id", "amount_cents") if key in plan}
        patch: dict[str, Any] = {"approved_action": action}
        granted = list(view.state.get("execution_permissions", []))
        needed = PERMISSION[plan["action"]]
        if needed not in granted:
            patch["execution_permissions"] = sorted([*granted, needed])
        return patch

    return handle


if __name__ == "__main__":
    main("approval-gate", make_handler)
