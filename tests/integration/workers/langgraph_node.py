"""A LangGraph node function for ``python -m ztate.langgraph.worker`` in tests: the
input parser's step (it reads raw_text, writes requested_action)."""

from __future__ import annotations

from typing import Any


def parse(state: dict[str, Any]) -> dict[str, Any]:
    assert set(state) == {"raw_text"}, state  # its projection, nothing more
    return {"requested_action": {"action": "lookup", "order_id": "A-42"}}


OTHER_USER = "223e4567-e89b-42d3-a456-426614174000"


def act_for_another_user(state: dict[str, Any]) -> dict[str, Any]:
    """The planner's step: a change of target_user_id, which a reviewer must approve."""
    assert "target_user_id" in state, state
    return {"target_user_id": OTHER_USER}
