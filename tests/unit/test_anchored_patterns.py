"""Every validating regular expression matches the whole text.

Python's ``$`` also matches before a trailing newline, so ``re.match(r"^x$",
"x\\n")`` succeeds: a digest, key id, name, idempotency key or timestamp with a
newline appended would pass a check written that way. The patterns end in ``\\Z``
(or are used with ``fullmatch``); this pins each one with a value it accepts.
"""

from __future__ import annotations

import re

import pytest

import approval_service.cli
import approval_service.service
import services.bundle
import services.chain
import services.credentials
import services.identity
import services.keyring
import services.receipts
import services.schema
import services.store.migrate
import services.verify
import transition_service.ledger_server
import transition_service.pipeline
import transition_service.reads
import worker_sdk._evidence
from services.errors import IdentityInvalid

DIGEST = "0" * 64
PATTERNS: dict[str, tuple[re.Pattern[str], str]] = {
    "approval cli digest": (approval_service.cli.DIGEST, DIGEST),
    "approval service digest": (approval_service.service.DIGEST, DIGEST),
    "approval page token": (approval_service.service.PAGE_TOKEN, f"12.{DIGEST}"),
    "bundle hex": (services.bundle.HEX_256, DIGEST),
    "chain hex": (services.chain.HEX_256, DIGEST),
    "credential member name": (services.credentials._PLAIN_NAME, "api_key"),
    "trust domain": (services.identity.TRUST_DOMAIN, "ztate.test"),
    "keyring key id": (services.keyring.KEY_ID, "k1"),
    "receipt key id": (services.receipts.KEY_ID, "approval-k1"),
    "receipt hex": (services.receipts.HEX_256, DIGEST),
    "date-time": (services.schema.RFC3339, "2026-11-21T10:00:00Z"),
    "migration file": (services.store.migrate.MIGRATION_FILE, "0001_ledger.sql"),
    "sql identifier": (services.store.migrate.IDENTIFIER, "ztate_transition"),
    "verify hex": (services.verify.HEX_256, DIGEST),
    "committed_at": (services.verify.COMMITTED_AT, "2026-11-21T10:00:00.000000Z"),
    "ledger digest": (transition_service.ledger_server.DIGEST, DIGEST),
    "key name": (transition_service.pipeline.KEY_NAME, "requested_action"),
    "idempotency key": (transition_service.pipeline.IDEMPOTENCY_KEY, "retry-1"),
    "reads digest": (transition_service.reads.DIGEST, DIGEST),
    "sdk key id": (worker_sdk._evidence.KEY_ID, "approval-k1"),
    "sdk hex": (worker_sdk._evidence.HEX_256, DIGEST),
    "sdk time": (worker_sdk._evidence.TIME, "2026-11-21T10:00:00.000000Z"),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_a_pattern_refuses_its_value_with_a_trailing_newline(name: str) -> None:
    pattern, value = PATTERNS[name]
    assert pattern.match(value) is not None
    assert pattern.match(value + "\n") is None


def test_an_identity_name_is_checked_whole() -> None:
    """NAME is also a pydantic pattern (no \\Z there): Python checks it with fullmatch."""
    parse = services.identity.parse_spiffe_id
    assert parse("spiffe://ztate.test/node/alice", "ztate.test").name == "alice"
    with pytest.raises(IdentityInvalid, match="identity name must match"):
        parse("spiffe://ztate.test/node/alice\n", "ztate.test")
