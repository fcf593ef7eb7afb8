"""Optional database layouts, applied only on an operator's explicit command.

The Citus layout (``ztate db citus``) distributes the transition service's tables
by ``thread_id``. It is kept out of the numbered migrations, which every
deployment applies, because it only makes sense on a Citus coordinator. It runs
in two steps: ``citus_prepare.sql`` changes the keys Citus cannot distribute (plain
SQL, valid on any Postgres) and ``citus_distribute.sql`` calls Citus' functions.
docs/scale-out.md explains the layout and its capacity model.
"""

from __future__ import annotations

from importlib import resources

import asyncpg

# Every table of schema ztate, by its place in the Citus layout. A migration that
# adds a table must place it here (tests/unit/test_citus_layout.py checks).
DISTRIBUTED = (
    "threads",
    "transitions",
    "pending_transitions",
    "checkpoints",
    "transition_keys",
    "watched_threads",
    "node_work",
    "wake_marks",
)
REFERENCE = ("receipts",)
COORDINATOR_LOCAL = ("rejections", "policies")


class CitusError(RuntimeError):
    """The Citus layout cannot be applied to this database."""


def layout_sql(name: str) -> str:
    """The text of ``citus_prepare`` or ``citus_distribute``."""
    return resources.files(__name__).joinpath(f"{name}.sql").read_text(encoding="utf-8")


def layout_statements(name: str) -> list[str]:
    """The statements of a layout file, in order. Each is sent alone: Citus propagates
    some commands on a distributed table to the workers as the text the client sent,
    so a whole file sent at once, once the tables are distributed (a second ``ztate db
    citus``), reached the workers as several commands in one prepared statement, which
    they refuse. The files are ours: a statement ends with the first line ending in
    ``;`` outside a dollar-quoted body (``$$``), and comment lines between statements
    are dropped."""
    statements: list[str] = []
    lines: list[str] = []
    quoted = False
    for line in layout_sql(name).splitlines():
        if not quoted and not lines and (not line.strip() or line.lstrip().startswith("--")):
            continue
        lines.append(line)
        if line.count("$$") % 2:
            quoted = not quoted
        if not quoted and line.rstrip().endswith(";"):
            statements.append("\n".join(lines))
            lines = []
    if lines:
        raise CitusError(f"{name}.sql ends inside a statement")
    return statements


async def prepare_for_citus(conn: asyncpg.Connection) -> None:
    """The schema changes the layout needs, in one transaction (any Postgres)."""
    async with conn.transaction():
        for statement in layout_statements("citus_prepare"):
            await conn.execute(statement)


async def apply_citus_layout(conn: asyncpg.Connection) -> list[str]:
    """Prepare and distribute; refuses, changing nothing, where Citus is not installed."""
    version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
    if version is None:
        raise CitusError(
            "the citus extension is not installed in this database "
            "(CREATE EXTENSION citus on the coordinator, add the workers, then retry)"
        )
    await prepare_for_citus(conn)
    for statement in layout_statements("citus_distribute"):
        await conn.execute(statement)
    return [
        f"citus {version}: distributed by thread_id: {', '.join(DISTRIBUTED)}",
        f"reference: {', '.join(REFERENCE)}; on the coordinator: {', '.join(COORDINATOR_LOCAL)}",
    ]
