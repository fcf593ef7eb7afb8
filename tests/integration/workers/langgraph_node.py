"""A LangGraph node function for ``python -m ztate.langgraph.worker`` in tests: the
input parser's step (it reads raw_text, writes requested_action)."""

from __future__ import annotations

from typing import Any


def parse(state: dict[str, Any]) -> dict[str, Any]:
    assert set(state) == {"raw_text"}, state  # its projection, nothing more
    return {"requested_action": {"action": "lookup", "order_id": "A-42"}}
