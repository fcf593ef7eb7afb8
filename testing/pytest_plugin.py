"""pytest fixtures for worker authors: ``pytest_plugins = ["ztate.testing.pytest_plugin"]``.

* ``ztate_policy``: the policy the control plane loads (a path, a folder, a mapping or a
  list of them); override it in a test module or ``conftest.py``. Default: the
  four-node pipeline of docs/policy.md.
* ``ztate_postgres_dsn`` (session): a superuser DSN of a Postgres server:
  ``ZTATE_TEST_DATABASE_URL`` if set, else one embedded server for the session.
* ``ztate_env``: a ``ZtateEnvironment`` per test, on a fresh database of that server.

Needs pytest-asyncio (``pip install 'ztate[testing]'``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ztate.testing._env import PolicySource, ZtateEnvironment


@pytest.fixture
def ztate_policy() -> PolicySource | list[PolicySource] | None:
    """The policy of ``ztate_env``; ``None`` is the shipped four-node pipeline."""
    return None


@pytest.fixture(scope="session")
def ztate_postgres_dsn() -> Iterator[str]:
    """A superuser DSN of a real Postgres server, one per session."""
    external = os.environ.get("ZTATE_TEST_DATABASE_URL")
    if external:
        yield external
        return
    from ztate.services.store.embedded import start_embedded_postgres

    with tempfile.TemporaryDirectory(prefix="ztate-pg-") as folder:
        dsn, server = start_embedded_postgres(Path(folder) / "data")
        try:
            yield dsn
        finally:
            server.cleanup()


@pytest_asyncio.fixture
async def ztate_env(ztate_policy: Any, ztate_postgres_dsn: str) -> AsyncIterator[ZtateEnvironment]:
    """A real control plane loading ``ztate_policy``, torn down after the test."""
    async with ZtateEnvironment.start(ztate_policy, postgres_dsn=ztate_postgres_dsn) as env:
        yield env
