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
import ztate.contract.keyring
import ztate.contract.receipts
import ztate.contract.record
import ztate.services.policy.credentials
import ztate.services.policy.schema
import ztate.services.runtime.identity
import ztate.services.store.migrate
import ztate.services.verify.bundle
import ztate.transition_service.checks
import ztate.transition_service.ledger_server
import ztate.transition_service.reads
from ztate.services.runtime.errors import IdentityInvalid

DIGEST = "0" * 64
PATTERNS: dict[str, tuple[re.Pattern[str], str]] = {
    "approval cli digest": (ztate.approval_service.cli.DIGEST, DIGEST),
    "approval service digest": (ztate.approval_service.service.DIGEST, DIGEST),
    "approval page token": (ztate.approval_service.service.PAGE_TOKEN, f"12.{DIGEST}"),
    "bundle hex": (ztate.services.verify.bundle.HEX_256, DIGEST),
    "chain hex": (ztate.contract.record.HEX_256, DIGEST),
    "credential member name": (ztate.services.policy.credentials._PLAIN_NAME, "api_key"),
    "trust domain": (ztate.services.runtime.identity.TRUST_DOMAIN, "ztate.test"),
    "keyring key id": (ztate.contract.keyring.KEY_ID, "k1"),
    "receipt nonce": (ztate.contract.receipts.NONCE, "0" * 32),
    "record time": (ztate.contract.record.TIME, "2026-11-21T10:00:00.000000Z"),
    "date-time": (ztate.services.policy.schema.RFC3339, "2026-11-21T10:00:00Z"),
    "migration file": (ztate.services.store.migrate.MIGRATION_FILE, "0001_ledger.sql"),
    "sql identifier": (ztate.services.store.migrate.IDENTIFIER, "ztate_transition"),
    "ledger digest": (ztate.transition_service.ledger_server.DIGEST, DIGEST),
    "idempotency key": (ztate.transition_service.checks.IDEMPOTENCY_KEY, "retry-1"),
    "reads digest": (ztate.transition_service.reads.DIGEST, DIGEST),
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
