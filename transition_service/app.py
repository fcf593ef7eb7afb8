"""Assembling and running the transition service from its settings."""

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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ztate.contract.errors import KeyFileError
from ztate.contract.keyring import Keyring, load_public_keys, load_signing_key
from ztate.services.policy.model import PolicySet
from ztate.services.runtime import tls
from ztate.services.runtime.config import Settings
from ztate.services.runtime.decoding import RefuseUndecodable
from ztate.services.runtime.health import DatabaseHealth, HealthReport, pool_ping
from ztate.services.runtime.identity import Authenticator
from ztate.services.runtime.reflection import enable_reflection
from ztate.services.runtime.revocation import Revocations
from ztate.services.runtime.serving import listen_on, raise_open_file_limit, server_options
from ztate.services.runtime.telemetry import Telemetry
from ztate.services.store.approvals import ApprovalStore
from ztate.services.store.embedded import start_embedded_postgres
from ztate.services.store.ledger import LedgerQueries
from ztate.services.store.migrate import TRANSITION_MIGRATIONS, migrate, verify_migrations
from ztate.services.store.policies import StoredPolicy, keep_policy_versions
from ztate.services.store.transitions import PostgresTransitionStore
from ztate.services.store.work import WorkStore
from ztate.transition_service.checkpointer import Checkpointer
from ztate.transition_service.decisions import DecisionPipeline
from ztate.transition_service.journal import CheckpointJournal, NotePublisher
from ztate.transition_service.ledger_server import LedgerServicer
from ztate.transition_service.outbox import ApprovalOutbox
from ztate.transition_service.outcomes import OutcomeListener
from ztate.transition_service.pipeline import TransitionPipeline
from ztate.transition_service.reads import ThreadReads
from ztate.transition_service.server import TransitionServicer
from ztate.transition_service.watch import Watcher
from ztate.transition_service.work import Leases, Waker, Work, WorkDispatcher
from ztate.v1 import ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc

log = logging.getLogger("ztate.transition")
SERVICE_NAME = transition_pb2.DESCRIPTOR.services_by_name["TransitionService"].full_name
LEDGER_SERVICE_NAME = ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name
SHUTDOWN_GRACE_SECONDS = 10.0


@dataclass
class RunningService:
    """A started transition service."""

    server: grpc.aio.Server
    port: int
    store: PostgresTransitionStore
    queries: LedgerQueries
    health: HealthReport
    listener: OutcomeListener
    outbox: ApprovalOutbox
    checkpointer: Checkpointer | None
    database_health: DatabaseHealth
    embedded: Any = field(default=None, repr=False)
    telemetry: Telemetry = field(default_factory=Telemetry)
    watcher: Watcher | None = None
    work: Work | None = None

    async def stop(self, grace: float | None = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop taking calls, let in-flight commits finish, then close the pool."""
        await self.health.enter_graceful_shutdown()
        await self.database_health.stop()
        if self.watcher is not None:
            self.watcher.shutdown()  # watch streams never finish on their own
        if self.work is not None:
            await self.work.dispatcher.stop()  # nor do work streams
        await self.outbox.stop()
        if self.checkpointer is not None:
            await self.checkpointer.stop()
        await self.server.stop(grace)
        await self.listener.close()
        await self.telemetry.stop_sampling()  # it queries through the store's pool
        await self.store.close()
        await self.queries.close()
        await self.telemetry.shutdown()


def server_credentials(settings: Settings) -> grpc.ServerCredentials:
    """The service's certificate, key and trusted CAs, read again when they change."""
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    assert settings.tls_ca is not None
    return tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)


def authenticator(settings: Settings) -> Authenticator:
    """Every call's identity step, with the revocation list (read again when it changes)."""
    assert settings.revocation_list_file is not None
    return Authenticator(settings.trust_domain, Revocations(settings.revocation_list_file))


def approval_public_keys(settings: Settings) -> dict[str, Ed25519PublicKey]:
    """The keys receipts are verified with; none means no receipt can verify."""
    path = settings.approval_public_keys_file
    assert path is not None
    if not path.exists():
        if settings.approval_target:
            raise KeyFileError(f"{path}: missing, and ZTATE_APPROVAL_TARGET is set")
        return {}
    return load_public_keys(path)


def approval_channel(settings: Settings) -> tls.ServiceChannel | None:
    """mTLS to the approval service, as this service's own identity (its files read
    again when they change)."""
    if not settings.approval_target:
        return None
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    assert settings.tls_ca is not None
    return tls.ServiceChannel(
        settings.approval_target,
        settings.tls_cert,
        settings.tls_key,
        settings.tls_ca,
        server_name=settings.approval_server_name,
    )


def resolve_dsn(settings: Settings) -> tuple[str, Any]:
    if settings.database_url is not None:
        return settings.database_url.get_secret_value(), None
    return start_embedded_postgres(settings.home / "pg")


async def start(
    settings: Settings,
    *,
    dsn: str | None = None,
    telemetry: Telemetry | None = None,
    share_port: bool = False,
) -> RunningService:
    """Validate everything, migrate, and start serving. Fails before binding on bad input.

    ``telemetry`` (by default built from ``settings``) is the service's to shut down.
    ``share_port``: one of ``ztate serve --workers N``'s processes, which bind the same
    port with SO_REUSEPORT (``transition_service.workers``); otherwise the port is this
    process's alone and a second service on it fails to start.
    """
    assert settings.policy_path is not None
    policies = PolicySet.load(settings.policy_path)
    keyring = Keyring.load(
        settings.hmac_keyring_file,
        settings.hmac_keyring.get_secret_value() if settings.hmac_keyring else None,
    )
    credentials = server_credentials(settings)
    callers = authenticator(settings)
    public_keys = approval_public_keys(settings)
    embedded = None
    if dsn is None:
        dsn, embedded = resolve_dsn(settings)

    conn = await asyncpg.connect(dsn)
    try:
        if settings.migrate_on_start:
            applied = await migrate(conn, settings.db_role, settings.db_reader_role)
        else:  # a migration job ran: only check (read-only)
            await verify_migrations(conn, TRANSITION_MIGRATIONS)
            applied = []
    finally:
        await conn.close()
    if applied:
        log.info("applied migrations: %s", ", ".join(applied))

    telemetry = telemetry or Telemetry.from_settings(settings)
    telemetry.instrument_asyncpg()
    try:
        return await _start_traced(
            settings,
            dsn,
            embedded,
            policies,
            keyring,
            credentials,
            callers,
            public_keys,
            telemetry,
            share_port,
        )
    except BaseException:
        await telemetry.shutdown()  # asyncpg un-instrumented, the providers closed
        raise


async def _start_traced(
    settings: Settings,
    dsn: str,
    embedded: Any,
    policies: PolicySet,
    keyring: Keyring,
    credentials: grpc.ServerCredentials,
    callers: Authenticator,
    public_keys: dict[str, Ed25519PublicKey],
    telemetry: Telemetry,
    share_port: bool,
) -> RunningService:
    store = await PostgresTransitionStore.open(
        dsn, role=settings.db_role, pool_size=settings.db_pool_size, metrics=telemetry.metrics
    )
    await store.ping()
    # every policy version a record will name is retrievable before the first record
    new = await keep_policy_versions(
        store.pool,
        (StoredPolicy(p.digest, p.name, p.body) for p in policies.policies.values()),
    )
    if new:
        log.info("kept %d new policy versions in ztate.policies", new)
    queries = await LedgerQueries.open(
        dsn,
        role=settings.db_reader_role,
        timeout_seconds=settings.ledger_query_timeout_seconds,
    )
    pipeline = TransitionPipeline(
        store=store,
        policies=policies,
        keyring=keyring,
        max_patch_bytes=settings.max_patch_bytes,
        max_state_bytes=settings.max_state_bytes,
        max_depth=settings.max_depth,
        head_cache_size=settings.head_cache_size,
        metrics=telemetry.metrics,
    )
    listener = OutcomeListener(dsn, settings.db_role)
    await listener.start()
    approvals = ApprovalStore(store.pool)
    reads = ThreadReads(store, policies)
    watcher = Watcher.from_settings(store, reads, listener, settings)
    work_store = WorkStore(store.pool)
    waker = Waker(work_store, policies)
    dispatcher = WorkDispatcher(
        store,
        work_store,
        policies,
        waker,
        listener,
        lease_seconds=settings.work_lease_seconds,
        poll_seconds=settings.work_poll_seconds,
        max_streams=settings.watch_max_streams,
        per_identity=settings.watch_max_streams_per_identity,
        lifetime=settings.watch_max_stream_seconds,
    )
    work = Work(waker, dispatcher, Leases(work_store, dispatcher))
    decisions = DecisionPipeline(
        store=store,
        approvals=approvals,
        keyring=keyring,
        public_keys=dict(public_keys),
        heads=pipeline.heads,
        listener=listener,
        policies=policies,
        max_state_bytes=settings.max_state_bytes,
        metrics=telemetry.metrics,
        revoked=lambda spiffe_id: callers.revoked(spiffe_id, None),
    )
    checkpointer = (
        Checkpointer(
            store,
            load_signing_key(settings.checkpoint_key_file),
            settings.checkpoint_key_id,
            settings.checkpoint_interval_seconds,
            keyring=keyring,
            journal=CheckpointJournal(settings.checkpoint_journal_file),
            notes=NotePublisher(
                settings.checkpoint_journal_file.parent / "notes", settings.trust_domain
            ),
        )
        if settings.checkpoint_journal_file is not None
        and settings.checkpoint_key_file is not None
        and settings.checkpoint_key_file.exists()
        else None
    )
    outbox = ApprovalOutbox(
        approvals=approvals,
        channel=approval_channel(settings),
        wake=pipeline.parked,
        interval=settings.outbox_interval_seconds,
        pending_ttl=timedelta(seconds=settings.pending_ttl_seconds),
    )
    raise_open_file_limit()
    options = [
        *server_options(
            max_request_bytes=settings.max_message_bytes,
            max_reply_bytes=settings.max_reply_bytes,
            handshake_timeout_seconds=settings.handshake_timeout_seconds,
            max_connection_age_seconds=settings.max_connection_age_seconds,
            # a stream's own end (its lifetime) comes first: the SDKs resume it anew
            connection_grace_seconds=settings.watch_max_stream_seconds + 30,
        ),
        ("grpc.max_concurrent_streams", 256),
    ]
    if share_port:  # the service's own processes, checked free by their supervisor
        options = [
            ("grpc.so_reuseport", 1) if name == "grpc.so_reuseport" else (name, value)
            for name, value in options
        ]
    server = grpc.aio.server(
        options=options,
        interceptors=[RefuseUndecodable(), *telemetry.server_interceptors()],
    )
    transition_pb2_grpc.add_TransitionServiceServicer_to_server(
        TransitionServicer(pipeline, decisions, callers, reads, watcher, work),
        server,
    )
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(
        # a page's rows fill the reply limit less room for the envelope
        LedgerServicer(queries, callers, settings.max_reply_bytes - 64 * 1024),
        server,
    )
    health = HealthReport((SERVICE_NAME, LEDGER_SERVICE_NAME))  # NOT_SERVING until checked
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    database_health = DatabaseHealth(
        health,
        pool_ping(store.pool, "ztate.threads", timeout=settings.health_timeout_seconds),
        interval=settings.health_interval_seconds,
        timeout=settings.health_timeout_seconds,
    )
    enable_reflection(
        (
            SERVICE_NAME,
            LEDGER_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ),
        server,
    )
    try:
        port = listen_on(server, settings.listen, credentials)
        # ZTATE_METRICS_LISTEN: GET /metrics, /readyz, /livez (docs/operations.md)
        telemetry.serve_metrics(health.serving_now)
    except BaseException:
        await listener.close()
        await store.close()
        await queries.close()
        raise
    await server.start()
    outbox.start()
    dispatcher.start()
    telemetry.watch_database(
        {"transition": store.pool, "ledger-reader": queries.pool},
        settings.metrics_interval_seconds,
        pending_from=store.pending_summary,
    )
    if checkpointer is not None:
        checkpointer.start()
    await database_health.check()  # SERVING from the first answer (migrations ran above)
    database_health.start()
    log.info(
        "transition service listening on port %d, policies %s, key %s",
        port,
        ", ".join(f"{p.name} ({p.digest[:12]})" for p in policies.policies.values()),
        keyring.current,
    )
    return RunningService(
        server,
        port,
        store,
        queries,
        health,
        listener,
        outbox,
        checkpointer,
        database_health,
        embedded,
        telemetry=telemetry,
        watcher=watcher,
        work=work,
    )


async def serve(
    settings: Settings, *, share_port: bool = False, started: Callable[[], None] | None = None
) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully; ``started()`` is called
    once the service serves (what fails before is a failure to start)."""
    telemetry = Telemetry.from_settings(settings)
    telemetry.install_globals()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):  # before "listening" is logged: a
        loop.add_signal_handler(signum, stop.set)  # SIGTERM right after it is graceful too
    running = await start(settings, telemetry=telemetry, share_port=share_port)
    if started is not None:
        started()
    await stop.wait()
    log.info("shutting down: finishing in-flight calls")
    await running.stop()
