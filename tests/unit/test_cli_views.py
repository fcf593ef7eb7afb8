"""The human views of one resource, as pure functions of a parsed reply: whatever the
reply holds, the text has no character a terminal acts on or reorders (the end-to-end
checks against a hostile server are in tests/integration/test_cli_hostile_server.py)."""

from __future__ import annotations

from ztate.approval_service.cli import review_text

HOSTILE = ("\x1b", "\x07", "\r", "\u202e", "\u2028", "\x9b")
ESC = "\x1b]0;TITLE\x07\x1b[31m\r\u202e\u2028\x9b"


def test_review_text_escapes_every_field_the_server_sent() -> None:
    review = {
        "digest": "d" + ESC,
        "status": "approved" + ESC,
        "thread_id": "t" + ESC,
        "base_version": 1,
        "node_id": "n" + ESC,
        "risk_rules": ["r" + ESC],
        "required_approvals": 2,
        "approvers": ["a" + ESC],
        "opened_at": "o" + ESC,
        "expires_at": "e" + ESC,
        "redacted_diff": {"changes": {"k" + ESC: {"old": 1, "new": "v" + ESC}}},
        "outcome": "committed" + ESC,
        "receipt": {
            "receipt": {"decision": "x" + ESC, "reviewers": ["y" + ESC], "nonce": "z"},
            "signature": "s",
            "key_id": "k",
        },
    }
    text = review_text(review)
    for raw in HOSTILE:
        assert raw not in text, repr(raw)
    assert "thread        t\\x1b]0;TITLE\\x07\\x1b[31m\\r\\u202e\\u2028\\x9b at base version 1" in (
        text.splitlines()
    )
    assert "  k\\x1b]0;TITLE\\x07\\x1b[31m\\r\\u202e\\u2028\\x9b" in text.splitlines()
