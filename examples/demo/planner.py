"""The planner: turns a requested action into a plan (``pending_transition``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _node import main

from ztate.worker_sdk import Handler, View, ZtateClient


def make_handler(_client: ZtateClient, _thread_id: str, _report: Callable[..., None]) -> Handler:
    planned: list[Any] = []

    def handle(view: View) -> dict[str, Any] | None:
        requested = view.state.get("requested_action")
        if not requested or requested.get("action") == "none" or requested in planned:
            return None
        planned.append(requested)
        plan = {
            key: requested[key]
            for key in ("action", "order_id", "amount_cents")
            if key in requested
        }
        plan["reason"] = f"customer request on behalf of {view.state.get('target_user_id')}"
        return {"pending_transition": plan}

    return handle


if __name__ == "__main__":
    main("planner", make_handler)
