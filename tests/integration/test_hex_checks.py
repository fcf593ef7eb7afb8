"""Every hex digest column refuses what is not 64 lower-case hex characters, by a CHECK
written without a counted regular expression (migration 0026, the approval service's
0005).

``x ~ '^[0-9a-f]{64}$'`` made Postgres build a 64-state DFA at every check, four times a
commit: 9 % of a backend's CPU in the group commit (docs/performance.md, "Issue 19,
seventh round"). ``length(x) = 64 AND x !~ '[^0-9a-f]'`` says the same; these tests hold
the two forms equal over hostile values, check that every constraint is written in the
new form, and that each column still refuses a bad digest, writing nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import fresh_database
from tests.integration.test_store_conformance import new_thread
from ztate.approval_service.app import migrate_approvals
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.services.store.migrate import migrate
from ztate.services.store.transitions import PostgresTransitionStore

HEX = "0123456789abcdef"
GOOD = (HEX * 4, "0" * 64, "f" * 64)

# (table, constraint) -> column: every hex digest CHECK of the two services' schemas
HEX_CHECKS = {
    ("ztate.threads", "threads_head_digest_check"): "head_digest",
    ("ztate.transitions", "transitions_digest_check"): "digest",
    ("ztate.transitions", "transitions_parent_digest_check"): "parent_digest",
    ("ztate.transitions", "transitions_signature_check"): "signature",
    ("ztate.pending_transitions", "pending_transitions_digest_check"): "digest",
    ("ztate.pending_transitions", "pending_transitions_parent_digest_check"): "parent_digest",
    ("ztate.checkpoints", "checkpoints_head_digest_check"): "head_digest",
    ("ztate.policies", "policies_policy_digest_check"): "policy_digest",
    ("ztate.receipts", "receipts_receipt_digest_check"): "receipt_digest",
    ("ztate_approval.reviews", "reviews_digest_check"): "digest",
}

BAD = (
    "",
    HEX.upper() * 4,  # upper case
    "a" * 63,
    "a" * 65,
    "a" * 63 + "g",
    "a" * 63 + "\n",  # `$` matches only at the very end
    "\n" + "a" * 63,
    "a" * 64 + "\n",
    " " + "a" * 63,
    "a" * 63 + "\u0663",  # ARABIC-INDIC DIGIT THREE: a digit, not a hex digit
    "a" * 63 + "\uff41",  # FULLWIDTH LATIN SMALL LETTER A
    "a" * 62 + "\u00e9",  # 63 characters, 64 bytes
    "a" * 63 + "\u00e9",  # 64 characters, 65 bytes
    "a" * 32 + "\u0301" + "a" * 31,  # a combining accent inside
    "\u200b" + "a" * 63,  # zero-width space
    "a" * 31 + "-" + "a" * 32,
)


@pytest_asyncio.fixture
async def admin(
    postgres_server_dsn: str, settings: Settings, keyring: Keyring
) -> AsyncIterator[asyncpg.Connection]:
    """A fresh database migrated by both services, one row in every table with a hex
    digest column (each test writes only rows it expects refused)."""
    dsn = await fresh_database(postgres_server_dsn)
    conn = await asyncpg.connect(dsn)
    await migrate(conn, settings.db_role)
    await migrate_approvals(dsn, "ztate_approval_test")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        thread_id, genesis = await new_thread(PostgresTransitionStore(pool), keyring)
    finally:
        await pool.close()
    await conn.execute(
        "INSERT INTO ztate.pending_transitions (digest, thread_id, base_version, "
        "parent_digest, node_id, proposal, state, risk_rules, idempotency_key, "
        "request_digest, status, parked_at) VALUES ($1, $2, 0, $3, 'n', '\\x7b7d', "
        "'\\x7b7d', ARRAY['r'], 'k', 'r', 'pending', now())",
        "d" * 64,
        thread_id,
        genesis.digest,
    )
    await conn.execute(
        "INSERT INTO ztate.checkpoints (thread_id, version, head_digest, checkpoint, "
        "signature, key_id, signed_at) VALUES ($1, 0, $2, '\\x7b7d', 's', 'k', now())",
        thread_id,
        genesis.digest,
    )
    await conn.execute(
        "INSERT INTO ztate.policies (policy_digest, policy_name, body) "
        "VALUES ($1, 'p', '\\x7b7d') ON CONFLICT DO NOTHING",
        "e" * 64,
    )
    await conn.execute(
        "INSERT INTO ztate.receipts (receipt_digest, transition_digest, decision, nonce, "
        "receipt, signature, key_id) VALUES ($1, $2, 'approve', 'n', '\\x7b7d', 's', 'k')",
        "c" * 64,
        "d" * 64,
    )
    await conn.execute(
        "INSERT INTO ztate_approval.reviews (digest, thread_id, base_version, node_id, "
        "risk_rules, required_approvals, proposal, redacted_diff, expires_at) "
        "VALUES ($1, $2, 0, 'n', ARRAY['r'], 1, '\\x7b7d', '\\x7b7d', now())",
        "d" * 64,
        thread_id,
    )
    yield conn
    await conn.close()


async def test_the_uncounted_form_accepts_exactly_what_the_counted_one_did(
    admin: asyncpg.Connection,
) -> None:
    values = [*GOOD, *BAD]
    rows = await admin.fetch(
        "SELECT v, v ~ '^[0-9a-f]{64}$' AS counted, "
        "       (length(v) = 64 AND v !~ '[^0-9a-f]') AS uncounted "
        "  FROM unnest($1::text[]) AS v",
        values,
    )
    assert [(r["v"], r["counted"]) for r in rows] == [(v, v in GOOD) for v in values]
    assert [(r["v"], r["uncounted"]) for r in rows] == [(v, v in GOOD) for v in values]


async def test_every_hex_digest_check_is_written_without_a_counted_repetition(
    admin: asyncpg.Connection,
) -> None:
    written = {
        (r["relation"], r["conname"]): r["definition"]
        for r in await admin.fetch(
            "SELECT conrelid::regclass::text AS relation, conname, "
            "       pg_get_constraintdef(oid) AS definition "
            "  FROM pg_constraint "
            " WHERE contype = 'c' AND connamespace IN ('ztate'::regnamespace, "
            "                                          'ztate_approval'::regnamespace) "
            "   AND pg_get_constraintdef(oid) LIKE '%0-9a-f%'"
        )
    }
    assert written == {
        key: f"CHECK (((length({column}) = 64) AND ({column} !~ '[^0-9a-f]'::text)))"
        for key, column in HEX_CHECKS.items()
    }


@pytest.mark.parametrize(("table", "constraint"), sorted(HEX_CHECKS))
async def test_each_hex_digest_column_refuses_a_bad_digest_and_writes_nothing(
    admin: asyncpg.Connection, table: str, constraint: str
) -> None:
    column = HEX_CHECKS[(table, constraint)]
    before = await admin.fetch(f"SELECT * FROM {table} ORDER BY 1")  # noqa: S608
    assert len(before) == 1
    for bad in BAD:
        # the table's one row, its digest replaced: the CHECK runs before any key
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await admin.execute(
                f"INSERT INTO {table} SELECT (jsonb_populate_record(NULL::{table}, "  # noqa: S608
                f"to_jsonb(r) || jsonb_build_object($1::text, $2::text))).* FROM {table} r",
                column,
                bad,
            )
        assert refused.value.constraint_name == constraint
        assert await admin.fetch(f"SELECT * FROM {table} ORDER BY 1") == before  # noqa: S608
