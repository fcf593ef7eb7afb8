"""The worker SDK: safe retries, the re-read-and-retry helper, the blocking client,
configuration from the environment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import timestamp_pb2

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.services.runtime import tls
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import StaleVersion, SyncZtateClient, Unavailable, View, ZtateClient


async def new_thread(target: str, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


async def test_update_rereads_and_reruns_when_another_writer_won(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    calls: list[int] = []
    async with (
        client(target, pki.node("input-parser")) as rival,
        client(target, pki.node("input-parser")) as worker,
    ):

        async def change(view: View) -> dict[str, Any]:
            calls.append(view.version)
            if len(calls) == 1:  # a rival commits between our read and our proposal
                await rival.propose(thread_id, view.version, {"requested_action": act("rival")})
            return {"requested_action": act(f"mine-after-{view.version}")}

        committed = await worker.update(thread_id, change)
    assert calls == [0, 1]
    assert committed.version == 2
    async with client(target, pki.operator()) as operator:
        record = (await operator.get_transition(thread_id=thread_id, version=2)).record
    assert record["patch"] == {"requested_action": act("mine-after-1")}


async def test_update_gives_up_after_its_attempts(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as rival,
        client(target, pki.node("input-parser")) as worker,
    ):

        async def always_beaten(view: View) -> dict[str, Any]:
            await rival.propose(thread_id, view.version, {"requested_action": act("rival")})
            return {"requested_action": act("mine")}

        with pytest.raises(StaleVersion):
            await worker.update(thread_id, always_beaten, attempts=2)


class FlakyTransitions(transition_pb2_grpc.TransitionServiceServicer):
    """A real gRPC server that is unavailable for the first ``failures`` proposals."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.keys: list[str] = []

    async def ProposeTransition(
        self, request: transition_pb2.ProposeTransitionRequest, context: Any
    ) -> transition_pb2.ProposeTransitionResponse:
        self.keys.append(request.idempotency_key)
        if len(self.keys) <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the database is restarting")
        at = timestamp_pb2.Timestamp()
        at.GetCurrentTime()
        return transition_pb2.ProposeTransitionResponse(
            transition=transition_pb2.Transition(
                thread_id=request.thread_id, version=1, committed_at=at
            )
        )


@pytest_asyncio.fixture
async def flaky(pki: Pki) -> AsyncIterator[tuple[str, FlakyTransitions]]:
    servicer = FlakyTransitions(failures=2)
    server = grpc.aio.server()
    transition_pb2_grpc.add_TransitionServiceServicer_to_server(servicer, server)
    certs = pki.certs
    port = server.add_secure_port(
        "127.0.0.1:0",
        tls.server_credentials(
            certs / "service-transition.crt", certs / "service-transition.key", certs / "ca.crt"
        ),
    )
    await server.start()
    yield f"localhost:{port}", servicer
    await server.stop(None)


async def test_transport_failures_are_retried_with_the_same_idempotency_key(
    flaky: tuple[str, FlakyTransitions], pki: Pki
) -> None:
    target, servicer = flaky
    creds = pki.node("input-parser")
    worker = ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, retries=3, backoff=0.01
    )
    async with worker:
        committed = await worker.propose("t", 0, {"requested_action": act("x")})
    assert committed.version == 1
    assert len(servicer.keys) == 3
    assert len(set(servicer.keys)) == 1  # one request, retried: the server dedupes it


async def test_retries_stop_and_raise_the_typed_error(
    flaky: tuple[str, FlakyTransitions], pki: Pki
) -> None:
    target, servicer = flaky
    creds = pki.node("input-parser")
    worker = ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, retries=1, backoff=0.01
    )
    async with worker:
        with pytest.raises(Unavailable):
            await worker.propose("t", 0, {"requested_action": act("x")})
    assert len(servicer.keys) == 2


async def test_the_blocking_client_and_configuration_from_the_environment(
    target: str, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    thread_id = await new_thread(target, pki)
    creds = pki.node("input-parser")
    for name, value in (
        ("TARGET", target),
        ("CERT", creds.cert),
        ("KEY", creds.key),
        ("CA", creds.ca),
    ):
        monkeypatch.setenv(f"ZTATE_WORKER_{name}", str(value))

    def work() -> tuple[dict[str, Any], int]:
        # a plain, blocking program, as a worker without asyncio would be
        with SyncZtateClient.from_env() as worker:
            view = worker.get_view(thread_id)
            committed = worker.propose(thread_id, view.version, {"requested_action": act("s")})
            return view.state, committed.version

    state, version = await asyncio.to_thread(work)
    assert state == {"raw_text": INITIAL["raw_text"]}
    assert version == 1


def test_from_env_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZTATE_WORKER_TARGET", "localhost:1")
    for name in ("CERT", "KEY", "CA"):
        monkeypatch.delenv(f"ZTATE_WORKER_{name}", raising=False)
    with pytest.raises(ValueError, match="ZTATE_WORKER_CERT, ZTATE_WORKER_KEY, ZTATE_WORKER_CA"):
        ZtateClient.from_env()
