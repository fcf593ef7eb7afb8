"""Assembling and running the approval service from its settings.

Everything that can be wrong with the configuration (the signing key, the
certificates, the webhook) is checked before anything binds or migrates, so a
bad deployment fails at once with a clear message rather than on the first
decision.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ztate.approval_service.delivery import ReceiptDelivery, transition_channel
from ztate.approval_service.notifier import Notifier, NullNotifier, WebhookNotifier
from ztate.approval_service.server import ApprovalServicer
from ztate.approval_service.service import ApprovalService
from ztate.approval_service.store import ReviewStore
from ztate.contract.keyring import load_signing_key
from ztate.services.runtime import tls
from ztate.services.runtime.config import ApprovalSettings
from ztate.services.runtime.decoding import RefuseUndecodable
from ztate.services.runtime.health import DatabaseHealth, HealthReport, pool_ping
from ztate.services.runtime.identity import Authenticator
from ztate.services.runtime.reflection import enable_reflection
from ztate.services.runtime.revocation import Revocations
from ztate.services.runtime.serving import (
    APPROVAL_MAX_MESSAGE_BYTES,
    listen_on,
    raise_open_file_limit,
    server_options,
)
from ztate.services.runtime.telemetry import Telemetry
from ztate.services.store.embedded import start_embedded_postgres
from ztate.services.store.migrate import MigrationSet, apply_migrations, verify_migrations
from ztate.v1 import approval_pb2, approval_pb2_grpc

log = logging.getLogger("ztate.approval")
SERVICE_NAME = approval_pb2.DESCRIPTOR.services_by_name["ApprovalService"].full_name
APPROVAL_MIGRATIONS = MigrationSet(
    "ztate.approval_service",
    "ztate_approval_schema_migrations",
    0x7A7461746532,  # "ztate2"
)
SHUTDOWN_GRACE_SECONDS = 10.0
# A submission carries the proposal and the record and state it builds on; a review,
# the proposal and its redacted diff (services.runtime.serving says what exceeds it).
MAX_MESSAGE_BYTES = APPROVAL_MAX_MESSAGE_BYTES


@dataclass
class RunningApproval:
    """A started approval service."""

    server: grpc.aio.Server
    port: int
    store: ReviewStore
    service: ApprovalService
    delivery: ReceiptDelivery
    notifier: Notifier
    health: HealthReport
    database_health: DatabaseHealth
    embedded: Any = field(default=None, repr=False)
    telemetry: Telemetry = field(default_factory=Telemetry)

    async def stop(self, grace: float | None = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop taking calls, let in-flight decisions finish, then stop delivering."""
        await self.health.enter_graceful_shutdown()
        await self.database_health.stop()
        await self.server.stop(grace)
        await self.delivery.stop()
        await self.notifier.close()
        await self.store.close()
        await self.telemetry.shutdown()


def server_credentials(settings: ApprovalSettings) -> grpc.ServerCredentials:
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    assert settings.tls_ca is not None
    return tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)


def authenticator(settings: ApprovalSettings) -> Authenticator:
    """Every call's identity step, with the revocation list (read again when it changes):
    a revoked reviewer decides nothing more."""
    assert settings.revocation_list_file is not None
    return Authenticator(settings.trust_domain, Revocations(settings.revocation_list_file))


def notifier_from(settings: ApprovalSettings) -> Notifier:
    """A signed webhook when one is configured, otherwise nobody is told."""
    if settings.webhook_url is None or settings.webhook_secret is None:
        return NullNotifier()
    return WebhookNotifier(
        settings.webhook_url, settings.webhook_secret.get_secret_value().encode("utf-8")
    )


def resolve_dsn(settings: ApprovalSettings) -> tuple[str, Any]:
    if settings.database_url is not None:
        return settings.database_url.get_secret_value(), None
    return start_embedded_postgres(settings.home / "pg")


async def migrate_approvals(dsn: str, role: str) -> list[str]:
    """Apply the approval service's pending migrations as the connecting (owner) role."""
    conn = await asyncpg.connect(dsn)
    try:
        return await apply_migrations(conn, APPROVAL_MIGRATIONS, {":approval_role": role})
    finally:
        await conn.close()


async def migrate_for_db_command(dsn: str, settings: ApprovalSettings) -> list[str]:
    """``ztate db migrate``'s part for this service (its ``ztate.migrations`` entry point)."""
    return await migrate_approvals(dsn, settings.db_role)


async def verify_approvals(dsn: str) -> list[str]:
    """Check, read-only, that the approval service's migrations were applied (none now)."""
    conn = await asyncpg.connect(dsn)
    try:
        await verify_migrations(conn, APPROVAL_MIGRATIONS)
    finally:
        await conn.close()
    return []


async def start(
    settings: ApprovalSettings, *, dsn: str | None = None, telemetry: Telemetry | None = None
) -> RunningApproval:
    """Validate everything, migrate, and start serving. Fails before binding on bad input.

    ``telemetry`` (by default built from ``settings``) is the service's to shut down.
    """
    assert settings.signing_key_file is not None
    signing_key = load_signing_key(settings.signing_key_file)
    credentials = server_credentials(settings)
    callers = authenticator(settings)
    notifier = notifier_from(settings)
    embedded = None
    if dsn is None:
        dsn, embedded = resolve_dsn(settings)

    if settings.migrate_on_start:
        applied = await migrate_approvals(dsn, settings.db_role)
    else:  # a migration job ran: only check (read-only)
        applied = await verify_approvals(dsn)
    if applied:
        log.info("applied approval migrations: %s", ", ".join(applied))
    telemetry = telemetry or Telemetry.from_settings(settings)
    telemetry.instrument_asyncpg()
    try:
        store = await ReviewStore.open(dsn, role=settings.db_role, pool_size=settings.db_pool_size)
    except BaseException:
        await telemetry.shutdown()
        raise
    try:
        running = await _serve_on(
            settings, store, signing_key, credentials, callers, notifier, embedded, telemetry
        )
    except BaseException:
        await store.close()
        await telemetry.shutdown()
        raise
    return running


async def _serve_on(
    settings: ApprovalSettings,
    store: ReviewStore,
    signing_key: Ed25519PrivateKey,
    credentials: grpc.ServerCredentials,
    callers: Authenticator,
    notifier: Notifier,
    embedded: Any,
    telemetry: Telemetry,
) -> RunningApproval:
    await store.ping()
    decided = asyncio.Event()
    service = ApprovalService(
        store=store,
        signing_key=signing_key,
        key_id=settings.key_id,
        notifier=notifier,
        trust_domain=settings.trust_domain,
        review_ttl=timedelta(seconds=settings.review_ttl_seconds),
        receipt_ttl=timedelta(seconds=settings.receipt_ttl_seconds),
        decided=decided,
        revoked=callers.revoked,
    )
    raise_open_file_limit()
    server = grpc.aio.server(
        options=server_options(
            max_request_bytes=MAX_MESSAGE_BYTES,
            max_reply_bytes=MAX_MESSAGE_BYTES,
            handshake_timeout_seconds=settings.handshake_timeout_seconds,
            max_connection_age_seconds=settings.max_connection_age_seconds,
            connection_grace_seconds=60,  # unary calls only
        ),
        interceptors=[RefuseUndecodable(), *telemetry.server_interceptors()],
    )
    approval_pb2_grpc.add_ApprovalServiceServicer_to_server(
        ApprovalServicer(service, callers), server
    )
    health = HealthReport((SERVICE_NAME,))  # NOT_SERVING until checked
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    database_health = DatabaseHealth(
        health,
        pool_ping(store.pool, "ztate_approval.reviews", timeout=settings.health_timeout_seconds),
        interval=settings.health_interval_seconds,
        timeout=settings.health_timeout_seconds,
    )
    enable_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ),
        server,
    )
    port = listen_on(server, settings.listen, credentials)
    # ZTATE_APPROVAL_METRICS_LISTEN: GET /metrics, /readyz, /livez (docs/operations.md)
    telemetry.serve_metrics(health.serving_now)
    await server.start()
    delivery = ReceiptDelivery(
        service=service,
        store=store,
        channel=transition_channel(settings),
        wake=decided,
        interval=settings.outbox_interval_seconds,
    )
    delivery.start()
    telemetry.watch_pools({"approval": store.pool})
    await database_health.check()  # SERVING from the first answer (migrations ran before)
    database_health.start()
    log.info(
        "approval service listening on port %d, signing key %s, delivering to %s",
        port,
        settings.key_id,
        settings.transition_target,
    )
    return RunningApproval(
        server,
        port,
        store,
        service,
        delivery,
        notifier,
        health,
        database_health,
        embedded,
        telemetry=telemetry,
    )


async def serve(settings: ApprovalSettings, *, started: Callable[[], None] | None = None) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully; ``started()`` is called
    once the service serves (what fails before is a failure to start)."""
    telemetry = Telemetry.from_settings(settings)
    telemetry.install_globals()
    running = await start(settings, telemetry=telemetry)
    if started is not None:
        started()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight calls")
    await running.stop()
