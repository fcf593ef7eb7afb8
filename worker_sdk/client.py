"""The asynchronous client an agent worker uses to talk to ztate."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from worker_sdk._tracing import client_interceptors
from worker_sdk.errors import AwaitingApproval, StaleVersion, from_rpc_error
from ztate.v1 import transition_pb2, transition_pb2_grpc

DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_RETRIES = 3
# Transport failures whose outcome is unknown or that never reached the service.
# Retried only for calls that are safe to repeat (a proposal keeps its
# idempotency key, so a retry returns the original outcome).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
Reply = TypeVar("Reply")


@dataclass(frozen=True, slots=True)
class Transition:
    """A committed ledger record, as the transition service returned it."""

    thread_id: str
    version: int
    digest: str
    parent_digest: str
    signature: str
    key_id: str
    node_id: str
    committed_at: datetime
    record_json: bytes
    replayed: bool = False

    @property
    def record(self) -> dict[str, Any]:
        """The parsed ledger record (see docs/ledger-format.md)."""
        parsed: dict[str, Any] = json.loads(self.record_json)
        return parsed

    @classmethod
    def from_message(cls, msg: transition_pb2.Transition, *, replayed: bool = False) -> Transition:
        return cls(
            thread_id=msg.thread_id,
            version=msg.version,
            digest=msg.digest,
            parent_digest=msg.parent_digest,
            signature=msg.signature,
            key_id=msg.key_id,
            node_id=msg.node_id,
            committed_at=msg.committed_at.ToDatetime(),
            record_json=msg.record_json,
            replayed=replayed,
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a parked transition: ``status`` is one of "pending",
    "committed", "rejected", "expired" or "stale"; ``transition`` is set once
    committed."""

    status: str
    transition: Transition | None = None


@dataclass(frozen=True, slots=True)
class View:
    """The keys of a thread's head this worker may read, at one version."""

    thread_id: str
    version: int
    head_digest: str
    state: dict[str, Any]


def encode_json(value: dict[str, Any]) -> bytes:
    """JSON for the wire; NaN and infinities are refused here, as the server would."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class ZtateClient:
    """A connection to the transition service, authenticated by this worker's certificate.

    Use it as an async context manager, or call ``close()``. Every method raises a
    subclass of ``worker_sdk.ZtateError`` when the call is refused.
    """

    def __init__(
        self,
        target: str,
        *,
        cert_pem: bytes,
        key_pem: bytes,
        ca_pem: bytes,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.1,
        tracer_provider: Any = None,
    ) -> None:
        self._retries = retries
        self._backoff = backoff
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        # Traced when OpenTelemetry is configured (or ``tracer_provider`` is given).
        self._channel = grpc.aio.secure_channel(
            target,
            credentials,
            options=options,
            interceptors=client_interceptors(tracer_provider) or None,
        )
        self._stub = transition_pb2_grpc.TransitionServiceStub(self._channel)
        self._timeout = timeout

    @classmethod
    def from_env(cls, prefix: str = "ZTATE_WORKER_") -> ZtateClient:
        """Connect from ``<prefix>TARGET``, ``CERT``, ``KEY``, ``CA`` (paths) and the
        optional ``SERVER_NAME``, as a container or a process manager sets them."""
        missing = [n for n in ("TARGET", "CERT", "KEY", "CA") if not os.environ.get(prefix + n)]
        if missing:
            raise ValueError(f"set {', '.join(prefix + n for n in missing)}")
        return cls.from_files(
            os.environ[prefix + "TARGET"],
            cert=os.environ[prefix + "CERT"],
            key=os.environ[prefix + "KEY"],
            ca=os.environ[prefix + "CA"],
            server_name=os.environ.get(prefix + "SERVER_NAME") or None,
        )

    async def _call(self, method: Callable[..., Awaitable[Reply]], request: object) -> Reply:
        """One RPC, retried with exponential backoff on transport failures."""
        attempt = 0
        while True:
            try:
                return await method(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE or attempt >= self._retries:
                    raise from_rpc_error(error) from None
            await asyncio.sleep(self._backoff * 2**attempt)
            attempt += 1

    @classmethod
    def from_files(
        cls,
        target: str,
        *,
        cert: str | Path,
        key: str | Path,
        ca: str | Path,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.1,
        tracer_provider: Any = None,
    ) -> ZtateClient:
        """Connect with a PEM certificate, its private key and the CA certificate.

        Calls that fail in transport (UNAVAILABLE, DEADLINE_EXCEEDED) and are safe
        to repeat are retried ``retries`` times, waiting ``backoff`` seconds, then
        twice that, and so on; a proposal keeps its idempotency key throughout.
        """
        return cls(
            target,
            cert_pem=Path(cert).read_bytes(),
            key_pem=Path(key).read_bytes(),
            ca_pem=Path(ca).read_bytes(),
            server_name=server_name,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            tracer_provider=tracer_provider,
        )

    async def __aenter__(self) -> ZtateClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(None)

    async def create_thread(
        self, thread_id: str, initial_state: dict[str, Any], *, policy: str = ""
    ) -> Transition:
        """Create a thread bound to ``policy`` (operator and service identities only).

        ``policy`` may be empty when the service loads a single policy. Returns the
        genesis transition.
        """
        request = transition_pb2.CreateThreadRequest(
            thread_id=thread_id, initial_state_json=encode_json(initial_state), policy=policy
        )
        try:
            response = await self._stub.CreateThread(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None
        return Transition.from_message(response.genesis)

    async def get_view(self, thread_id: str) -> View:
        """The head of a thread, projected to the keys this worker may read."""
        response = await self._call(
            self._stub.GetView, transition_pb2.GetViewRequest(thread_id=thread_id)
        )
        return View(
            thread_id=response.thread_id,
            version=response.version,
            head_digest=response.head_digest,
            state=json.loads(response.state_json),
        )

    async def propose(
        self,
        thread_id: str,
        expected_version: int,
        patch: dict[str, Any] | bytes,
        *,
        idempotency_key: str | None = None,
    ) -> Transition:
        """Propose a patch against ``expected_version``; returns the committed transition.

        Raises ``AwaitingApproval`` when the patch matched a risk rule and was parked
        instead of committed. Pass the same ``idempotency_key`` when retrying a call
        whose outcome is unknown: the server then returns the original outcome.
        """
        request = transition_pb2.ProposeTransitionRequest(
            thread_id=thread_id,
            expected_version=expected_version,
            patch_json=patch if isinstance(patch, bytes) else encode_json(patch),
            idempotency_key=idempotency_key or uuid.uuid4().hex,
        )
        response = await self._call(self._stub.ProposeTransition, request)
        if response.WhichOneof("outcome") == "pending":
            pending = response.pending
            raise AwaitingApproval(
                pending.digest, pending.thread_id, pending.base_version, tuple(pending.risk_rules)
            )
        return Transition.from_message(response.transition, replayed=response.replayed)

    async def get_transition(
        self, *, digest: str | None = None, thread_id: str | None = None, version: int | None = None
    ) -> Transition:
        """One ledger record by digest, or by thread and version (operators only)."""
        if digest is not None:
            request = transition_pb2.GetTransitionRequest(digest=digest)
        elif thread_id is not None and version is not None:
            request = transition_pb2.GetTransitionRequest(
                thread_version=transition_pb2.ThreadVersion(thread_id=thread_id, version=version)
            )
        else:
            raise ValueError("give digest, or thread_id and version")
        response = await self._call(self._stub.GetTransition, request)
        return Transition.from_message(response.transition)

    async def wait_for_outcome(self, digest: str, *, within: float = 60.0) -> Outcome:
        """Wait until the parked transition ``digest`` is decided, or ``within`` seconds pass.

        The server answers as soon as the outcome is known, without polling on this
        side; a "pending" outcome means the time ran out first.
        """
        request = transition_pb2.WaitForOutcomeRequest(digest=digest)
        try:
            response = await self._stub.WaitForOutcome(request, timeout=within)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None
        status = transition_pb2.Outcome.Name(response.outcome).removeprefix("OUTCOME_").lower()
        transition = (
            Transition.from_message(response.transition)
            if response.HasField("transition")
            else None
        )
        return Outcome(status, transition)

    async def update(
        self,
        thread_id: str,
        change: Callable[[View], dict[str, Any] | Awaitable[dict[str, Any]]],
        *,
        attempts: int = 5,
    ) -> Transition:
        """Read the view, compute a patch with ``change(view)`` and propose it; when
        another writer got there first (STALE_VERSION), read again and re-run
        ``change``, up to ``attempts`` times. Any other refusal is raised at once."""
        for attempt in range(attempts):
            view = await self.get_view(thread_id)
            patch = change(view)
            if inspect.isawaitable(patch):
                patch = await patch
            try:
                return await self.propose(thread_id, view.version, patch)
            except StaleVersion:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")
