"""The databases a suite can run on: plain Postgres (every lane) and Citus (the
``citus`` lane only). A module-scoped fixture parametrized with ``LANES`` runs its
module's tests on both, each on a fresh database of its own."""

from __future__ import annotations

import pytest

from tests.citus.cluster import ztate_database
from tests.harness import fresh_database

LANES = [pytest.param("postgres", id="postgres"), pytest.param("citus", marks=pytest.mark.citus)]


async def lane_database(lane: str, request: pytest.FixtureRequest) -> str:
    """A fresh database of ``lane``: on Citus, migrated and distributed as an operator
    does it (``ztate db migrate``, ``ztate db citus``); on Postgres, empty (the service
    migrates it at start-up)."""
    if lane == "citus":
        return await ztate_database(request.getfixturevalue("citus_cluster"))
    return await fresh_database(request.getfixturevalue("postgres_server_dsn"))
