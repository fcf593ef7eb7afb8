"""Every validating regular expression matches the whole text.

Python's ``$`` also matches before a trailing newline, so ``re.match(r"^x$",
"x\\n")`` succeeds: a digest, key id, name, idempotency key or timestamp with a
newline appended would pass a check written that way. The patterns end in ``\\Z``
(or are used with ``fullmatch``); this pins each one with a value it accepts.
"""

from __future__ import annotations

import re

import pytest

import ztate.approval_service.cli
import ztate.approval_service.service
import ztate.services.chain
import ztate.services.keyring
import ztate.services.policy.credentials
import ztate.services.policy.schema
import ztate.services.receipts
import ztate.services.runtime.identity
import ztate.services.store.migrate
import ztate.services.verify.bundle
import ztate.services.verify.checks
import ztate.transition_service.checks
import ztate.transition_service.ledger_server
import ztate.transition_service.reads
import ztate.worker_sdk._evidence
from ztate.services.runtime.errors import IdentityInvalid

DIGEST = "0" * 64
PATTERNS: dict[str, tuple[re.Pattern[str], str]] = {
    "approval cli digest": (ztate.approval_service.cli.DIGEST, DIGEST),
    "approval service digest": (ztate.approval_service.service.DIGEST, DIGEST),
    "approval page token": (ztate.approval_service.service.PAGE_TOKEN, f"12.{DIGEST}"),
    "bundle hex": (ztate.services.verify.bundle.HEX_256, DIGEST),
    "chain hex": (ztate.services.chain.HEX_256, DIGEST),
    "credential member name": (ztate.services.policy.credentials._PLAIN_NAME, "api_key"),
    "trust domain": (ztate.services.runtime.identity.TRUST_DOMAIN, "ztate.test"),
    "keyring key id": (ztate.services.keyring.KEY_ID, "k1"),
    "receipt key id": (ztate.services.receipts.KEY_ID, "approval-k1"),
    "receipt hex": (ztate.services.receipts.HEX_256, DIGEST),
    "date-time": (ztate.services.policy.schema.RFC3339, "2026-11-21T10:00:00Z"),
    "migration file": (ztate.services.store.migrate.MIGRATION_FILE, "0001_ledger.sql"),
    "sql identifier": (ztate.services.store.migrate.IDENTIFIER, "ztate_transition"),
    "verify hex": (ztate.services.verify.checks.HEX_256, DIGEST),
    "committed_at": (ztate.services.verify.checks.COMMITTED_AT, "2026-11-21T10:00:00.000000Z"),
    "ledger digest": (ztate.transition_service.ledger_server.DIGEST, DIGEST),
    "idempotency key": (ztate.transition_service.checks.IDEMPOTENCY_KEY, "retry-1"),
    "reads digest": (ztate.transition_service.reads.DIGEST, DIGEST),
    "sdk key id": (ztate.worker_sdk._evidence.KEY_ID, "approval-k1"),
    "sdk hex": (ztate.worker_sdk._evidence.HEX_256, DIGEST),
    "sdk time": (ztate.worker_sdk._evidence.TIME, "2026-11-21T10:00:00.000000Z"),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_a_pattern_refuses_its_value_with_a_trailing_newline(name: str) -> None:
    pattern, value = PATTERNS[name]
    assert pattern.match(value) is not None
    assert pattern.match(value + "\n") is None


def test_an_identity_name_is_checked_whole() -> None:
    """NAME is also a pydantic pattern (no \\Z there): Python checks it with fullmatch."""
    parse = ztate.services.runtime.identity.parse_spiffe_id
    assert parse("spiffe://ztate.test/node/alice", "ztate.test").name == "alice"
    with pytest.raises(IdentityInvalid, match="identity name must match"):
        parse("spiffe://ztate.test/node/alice\n", "ztate.test")
