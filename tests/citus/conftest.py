"""Fixtures of the Citus lane: a database of the session's cluster (``citus_cluster``
in tests/conftest.py) laid out by ``ztate db migrate`` and ``ztate db citus``, and a
transition service on it, per module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.citus.cluster import CitusCluster, ztate_database
from tests.harness import Ledger
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start


@pytest_asyncio.fixture(scope="module")
async def citus_dsn(citus_cluster: CitusCluster) -> str:
    """The coordinator's superuser DSN of a database of this module's own."""
    return await ztate_database(citus_cluster)


@pytest_asyncio.fixture(scope="module")
async def citus_service(settings: Settings, citus_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(settings, dsn=citus_dsn)
    yield running
    await running.stop(grace=1.0)


@pytest_asyncio.fixture(scope="module")
async def citus_target(citus_service: RunningService) -> str:
    return f"localhost:{citus_service.port}"


@pytest_asyncio.fixture(scope="module")
async def citus_ledger(citus_dsn: str, keyring: Keyring) -> Ledger:
    return Ledger(citus_dsn, keyring)
