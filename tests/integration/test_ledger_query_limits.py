"""An operator's ledger query is bounded in time, and a page of rejections is led by
an index whatever the filter (real gRPC, mTLS and Postgres)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import Pki, secure_channel, serving_console
from ztate.services.console.backend import Backend, Identity
from ztate.services.runtime.config import Settings
from ztate.services.store.ledger import LIST_REJECTIONS
from ztate.transition_service.app import RunningService, start
from ztate.v1 import errors_pb2, ledger_pb2, ledger_pb2_grpc
from ztate.worker_sdk import QueryTooCostly
from ztate.worker_sdk.errors import from_rpc_error

TIMEOUT_SECONDS = 0.3


@pytest_asyncio.fixture
async def bounded(settings: Settings, database_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(
        settings.model_copy(update={"ledger_query_timeout_seconds": TIMEOUT_SECONDS}),
        dsn=database_dsn,
    )
    yield running
    await running.stop(grace=1.0)


async def test_a_query_past_the_limit_is_refused_and_the_next_one_answers(
    bounded: RunningService, pki: Pki, database_dsn: str
) -> None:
    """A query the database cancels at the reader's statement timeout is refused
    QUERY_TOO_COSTLY (not the UNAVAILABLE "retry" of an outage, the class asyncpg
    files it under), with the limit; the reader's connection serves the next query."""
    blocker = await asyncpg.connect(database_dsn)
    try:
        async with secure_channel(f"localhost:{bounded.port}", pki.operator()) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            async with blocker.transaction():
                # what a query that runs long looks like to its statement: time passes
                await blocker.execute("LOCK TABLE ztate.rejections IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListRejections(
                        ledger_pb2.ListRejectionsRequest(reason="STALE_VERSION"), timeout=10
                    )
            error = from_rpc_error(refused.value)
            assert isinstance(error, QueryTooCostly)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.reason == "QUERY_TOO_COSTLY"
            assert error.limit == round(TIMEOUT_SECONDS * 1000)
            assert "narrow it" in (refused.value.details() or "")
            assert "STALE_VERSION" not in (refused.value.details() or "")
            # the lock is gone with the transaction: the same query answers
            answered = await stub.ListRejections(
                ledger_pb2.ListRejectionsRequest(reason="STALE_VERSION"), timeout=10
            )
            assert isinstance(answered, ledger_pb2.ListRejectionsResponse)
    finally:
        await blocker.close()


async def test_the_console_and_the_cli_say_query_too_costly(
    bounded: RunningService, pki: Pki, database_dsn: str
) -> None:
    """A query the database cancels is, on the console's rejections page, 429 with the
    reason and its advice (not the 502 of a service that answered nonsense), and, from
    ``ztate ledger rejections``, exit 1 with the reason on one line (no traceback)."""
    operator = pki.operator()
    target = f"localhost:{bounded.port}"
    blocker = await asyncpg.connect(database_dsn)
    try:
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE ztate.rejections IN ACCESS EXCLUSIVE MODE")
            backend = Backend(
                Identity(target, operator.cert, operator.key, operator.ca),
                Identity(target, operator.cert, operator.key, operator.ca),
            )
            async with serving_console(backend) as console:
                await console.sign_in()
                async with console.session.get(f"{console.base}/rejections") as got:
                    page = await got.text()
                    assert got.status == 429, page
            assert "QUERY_TOO_COSTLY" in page
            assert "narrow it" in page
            process = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).with_name("ztate")),
                *("ledger", "rejections", "--address", target),
                *("--client-cert", str(operator.cert), "--client-key", str(operator.key)),
                *("--ca-cert", str(operator.ca)),
                env={k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 1, err
        assert out == b""
        said = err.decode()
        assert said.startswith("ztate: QUERY_TOO_COSTLY: "), said
        assert "narrow it" in said
        assert said.count("\n") == 1
        assert "Traceback" not in said
    finally:
        await blocker.close()


def test_the_reason_is_in_the_contract() -> None:
    assert errors_pb2.ErrorReason.Name(38) == "ERROR_REASON_QUERY_TOO_COSTLY"


ROWS = 60_000
RARE = 5
PAGE = 100
# names no other test's rejections hold: the session's database is shared by the files
# one worker runs, and their refusals are in the same table
TAG = uuid.uuid4().hex[:8]
RARE_REASON = f"RARE_{TAG.upper()}"
BUSY_THREAD = f"t-{TAG}-1"
BUSY_NODE = f"spiffe://ztate.test/node/n{TAG}-1"


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", ()):
        found += _nodes(child)
    return found


@pytest.mark.parametrize(
    ("filters", "index", "returned"),
    [
        ({"reason": RARE_REASON}, "rejections_by_reason_id", RARE),
        ({"thread_id": BUSY_THREAD}, "rejections_by_thread_id", PAGE),
        ({"node_id": BUSY_NODE}, "rejections_by_node_id", PAGE),
        ({"thread_id": BUSY_THREAD, "reason": "STALE_VERSION"}, "rejections_by_thread_id", PAGE),
    ],
)
async def test_a_page_of_rejections_reads_the_rows_it_returns(
    service: RunningService,  # the database migrated
    database_dsn: str,
    filters: dict[str, str],
    index: str,
    returned: int,
) -> None:
    """On a table of many rejections, a page of a rare reason, or of a thread or node
    that holds a thousand rejections, is read from an index in the page's order (no
    sort of all the thread's or node's rows, no walk of every row from the newest), as
    the ledger's reader plans it (a custom plan for the filters given)."""
    conn = await asyncpg.connect(database_dsn)
    try:
        async with conn.transaction():  # rolled back: the table is left as it was
            await conn.execute(
                """INSERT INTO ztate.rejections (method, node_id, thread_id, reason, message)
                   SELECT 'ProposeTransition', $2::text || (i % 5000), $3::text || (i % 5000),
                          'STALE_VERSION', 'stale'
                     FROM pg_catalog.generate_series(1, $1) AS i""",
                ROWS,
                f"spiffe://ztate.test/node/n{TAG}-",
                f"t-{TAG}-",
            )
            await conn.execute(
                """INSERT INTO ztate.rejections (method, node_id, thread_id, reason, message)
                   SELECT 'ProposeTransition', 'spiffe://ztate.test/node/rare', 'rare-thread',
                          $2::text, 'credential'
                     FROM pg_catalog.generate_series(1, $1)""",
                RARE,
                RARE_REASON,
            )
            await conn.execute(
                """INSERT INTO ztate.rejections (method, node_id, thread_id, reason, message)
                   SELECT 'ProposeTransition', $1::text, $2::text, 'STALE_VERSION', 'stale'
                     FROM pg_catalog.generate_series(1, 1000)""",
                BUSY_NODE,
                BUSY_THREAD,
            )
            await conn.execute("ANALYZE ztate.rejections")
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            args = [
                filters.get("thread_id"),
                filters.get("node_id"),
                filters.get("reason"),
                None,
                None,
                None,
                PAGE,
            ]
            rows = await conn.fetch(LIST_REJECTIONS, *args)
            assert len(rows) == returned
            explained = await conn.fetchval("EXPLAIN (FORMAT JSON) " + LIST_REJECTIONS, *args)
            plan = json.loads(explained)
            nodes = _nodes(plan[0]["Plan"])
            assert [n["Index Name"] for n in nodes if "Index Name" in n] == [index]
            assert not [n for n in nodes if n["Node Type"] in ("Sort", "Seq Scan")]
            raise _RolledBack
    except _RolledBack:
        pass
    finally:
        await conn.close()


class _RolledBack(Exception):
    """Leaves the transaction by rolling it back."""
