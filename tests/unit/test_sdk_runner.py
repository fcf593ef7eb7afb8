"""The SDK's watch, runner and pre-action check against a scripted server: real gRPC
and mTLS, with each answer chosen by the test (a transport failure mid-stream, a
stale version, a refusal, a parked proposal, a head without a receipt)."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf import timestamp_pb2

from tests.harness import Pki
from tests.unit.test_contract_evidence import PATCH, RULES, T0, approved
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.checkpoints import sign_checkpoint
from ztate.services.runtime import errors, rpc_errors, tls
from ztate.v1 import approval_pb2, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import (
    HeadNotVerified,
    NodeRunner,
    NotFound,
    ProtocolError,
    Unavailable,
    View,
    ZtateClient,
    verify_head_before_acting,
)
from ztate.worker_sdk import client as client_module

THREAD = "order-42"


async def refuse(context: Any, error: errors.ZtateError) -> None:
    status = rpc_errors.to_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)


def stamp() -> timestamp_pb2.Timestamp:
    at = timestamp_pb2.Timestamp()
    at.FromDatetime(T0)
    return at


def committed(version: int, digest: str = "f" * 64) -> transition_pb2.Transition:
    return transition_pb2.Transition(
        thread_id=THREAD, version=version, digest=digest, committed_at=stamp()
    )


class Scripted(transition_pb2_grpc.TransitionServiceServicer):
    """Answers as the test says; records what it was asked."""

    def __init__(self) -> None:
        self.watch_from: list[int] = []
        self.proposals: list[transition_pb2.ProposeTransitionRequest] = []
        self.watch: Callable[[int, int], AsyncIterator[transition_pb2.WatchThreadResponse]]
        self.propose: Callable[[int, Any], Any]
        self.view_version = 0
        self.view_state = b'{"n":1}'
        self.record: transition_pb2.GetTransitionResponse | None = None
        self.checkpoint: transition_pb2.SignedCheckpoint | None = None
        self.outcome = transition_pb2.WaitForOutcomeResponse()
        self.view_failures = 0
        self.view_calls = 0
        self.created = transition_pb2.CreateThreadResponse()
        self.create_calls = 0
        self.renewed = transition_pb2.RenewLeaseResponse()
        self.renew_refusal: errors.ZtateError | None = None
        self.renewals: list[int] = []  # the epochs asked to be renewed
        self.renew_asked = asyncio.Event()
        self.renew_gate = asyncio.Event()  # RenewLease answers once it is set
        self.renew_gate.set()
        self.releases: list[tuple[int, int]] = []  # (epoch, handled_version)
        self.released = asyncio.Event()
        self.work: list[transition_pb2.SubscribeWorkResponse] = []
        self.asked: list[str] = []  # the calls answered from the fields above

    async def CreateThread(
        self, request: transition_pb2.CreateThreadRequest, context: Any
    ) -> transition_pb2.CreateThreadResponse:
        self.create_calls += 1
        return self.created

    async def WatchThread(
        self, request: transition_pb2.WatchThreadRequest, context: Any
    ) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        self.watch_from.append(request.from_version)
        try:
            async for message in self.watch(len(self.watch_from), request.from_version):
                yield message
        except errors.ZtateError as refusal:
            await refuse(context, refusal)
        except ConnectionError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is restarting")

    async def GetView(
        self, request: transition_pb2.GetViewRequest, context: Any
    ) -> transition_pb2.GetViewResponse:
        self.view_calls += 1
        if self.view_calls <= self.view_failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is restarting")
        return transition_pb2.GetViewResponse(
            thread_id=THREAD, version=self.view_version, state_json=self.view_state, head_digest="f"
        )

    async def ProposeTransition(
        self, request: transition_pb2.ProposeTransitionRequest, context: Any
    ) -> transition_pb2.ProposeTransitionResponse:
        self.proposals.append(request)
        try:
            response: transition_pb2.ProposeTransitionResponse = self.propose(
                len(self.proposals), request
            )
        except errors.ZtateError as refusal:
            await refuse(context, refusal)
            raise
        return response

    async def WaitForOutcome(
        self, request: transition_pb2.WaitForOutcomeRequest, context: Any
    ) -> transition_pb2.WaitForOutcomeResponse:
        self.asked.append("WaitForOutcome")
        return self.outcome

    async def GetTransition(
        self, request: transition_pb2.GetTransitionRequest, context: Any
    ) -> transition_pb2.GetTransitionResponse:
        assert THREAD in (request.head_of_thread, request.thread_version.thread_id)
        assert self.record is not None
        self.asked.append("GetTransition")
        return self.record

    async def RenewLease(
        self, request: transition_pb2.RenewLeaseRequest, context: Any
    ) -> transition_pb2.RenewLeaseResponse:
        self.asked.append("RenewLease")
        self.renewals.append(request.lease_epoch)
        self.renew_asked.set()
        await self.renew_gate.wait()
        if self.renew_refusal is not None:
            await refuse(context, self.renew_refusal)
        return self.renewed

    async def ReleaseLease(
        self, request: transition_pb2.ReleaseLeaseRequest, context: Any
    ) -> transition_pb2.ReleaseLeaseResponse:
        self.releases.append((request.lease_epoch, request.handled_version))
        self.released.set()
        return transition_pb2.ReleaseLeaseResponse()

    async def SubscribeWork(
        self, request: transition_pb2.SubscribeWorkRequest, context: Any
    ) -> AsyncIterator[transition_pb2.SubscribeWorkResponse]:
        self.asked.append("SubscribeWork")
        for item in self.work:
            yield item
        await forever()

    async def GetCheckpoint(
        self, request: transition_pb2.GetCheckpointRequest, context: Any
    ) -> transition_pb2.GetCheckpointResponse:
        if self.checkpoint is None:
            return transition_pb2.GetCheckpointResponse()
        return transition_pb2.GetCheckpointResponse(checkpoint=self.checkpoint)


def event(version: int, state: bytes = b'{"n":1}') -> transition_pb2.WatchThreadResponse:
    return transition_pb2.WatchThreadResponse(
        thread_id=THREAD, version=version, digest=f"{version:064x}", state_json=state
    )


async def forever() -> None:
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def scripted_server(pki: Pki) -> AsyncIterator[tuple[Scripted, str]]:
    """A ``Scripted`` service over real mTLS (the test PKI's service certificate, client
    certificates required), and its address."""
    servicer = Scripted()
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
    try:
        yield servicer, f"localhost:{port}"
    finally:
        await server.stop(None)


@pytest_asyncio.fixture
async def scripted(pki: Pki) -> AsyncIterator[tuple[Scripted, ZtateClient]]:
    async with scripted_server(pki) as (servicer, target):
        creds = pki.node("db-writer")
        worker = ZtateClient.from_files(
            target, cert=creds.cert, key=creds.key, ca=creds.ca, backoff=0.01
        )
        yield servicer, worker
        await worker.close()


# --- watch ------------------------------------------------------------------------------


async def test_watch_resumes_after_the_last_version_when_the_stream_breaks(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted

    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        for version in range(after + 1, 3 if call == 1 else 5):
            yield event(version)
        if call == 1:
            raise ConnectionError
        await forever()

    servicer.watch = watch
    seen = []
    async for change in worker.watch(THREAD):
        seen.append(change.version)
        if change.version == 4:
            break
    assert seen == [0, 1, 2, 3, 4]  # nothing skipped, nothing repeated
    assert servicer.watch_from == [-1, 2]


async def test_watch_resumes_after_a_normal_end_without_counting_it_as_a_failure(
    scripted: tuple[Scripted, ZtateClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends each stream (OK) at its maximum lifetime: the SDK resumes from
    the last version every time, however often, even with no reconnects allowed."""
    servicer, worker = scripted
    monkeypatch.setattr(client_module, "NORMAL_END_SECONDS", 0.0)  # every end "served"

    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        if call % 2 == 1:
            yield event(after + 1)  # one version per lifetime, then a lifetime with none

    servicer.watch = watch
    seen = []
    async for change in worker.watch(THREAD, reconnects=0):
        seen.append(change.version)
        if change.version == 4:
            break
    assert seen == [0, 1, 2, 3, 4]
    assert servicer.watch_from == [-1, 0, 0, 1, 1, 2, 2, 3, 3]


async def test_a_stream_that_ends_at_once_with_nothing_counts_as_a_failure(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted

    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        return
        yield event(0)  # pragma: no cover - makes this a generator

    servicer.watch = watch
    with pytest.raises(Unavailable):
        await anext(worker.watch(THREAD, reconnects=2))
    assert servicer.watch_from == [-1, -1, -1]


async def test_watch_raises_a_refusal_at_once(scripted: tuple[Scripted, ZtateClient]) -> None:
    servicer, worker = scripted

    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        raise errors.ThreadNotFound(f"thread {THREAD!r} does not exist")
        yield event(0)  # pragma: no cover - makes this a generator

    servicer.watch = watch
    with pytest.raises(NotFound) as refused:
        await anext(worker.watch(THREAD))
    assert refused.value.reason == "THREAD_NOT_FOUND"
    assert servicer.watch_from == [-1]  # not retried


async def test_reads_are_retried_through_transport_failures_then_give_up(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.view_failures = 2
    view = await worker.get_view(THREAD)  # three attempts: two failures, then the answer
    assert (view.version, servicer.view_calls) == (0, 3)
    servicer.view_calls, servicer.view_failures = 0, 10
    with pytest.raises(Unavailable):
        await worker.get_view(THREAD)
    assert servicer.view_calls == 4  # the first call and its three retries


async def test_a_thread_created_without_its_genesis_is_a_protocol_error(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.created = transition_pb2.CreateThreadResponse(replayed=True)  # no genesis
    with pytest.raises(ProtocolError) as failed:
        await worker.create_thread(THREAD, {"n": 1})
    assert (failed.value.code, failed.value.reason) == (grpc.StatusCode.INTERNAL, "BAD_REPLY")
    assert str(failed.value) == "BAD_REPLY: the service answered CreateThread without the genesis"
    assert servicer.create_calls == 1  # not retried
    # with its genesis, the answer is the transition
    servicer.created = transition_pb2.CreateThreadResponse(genesis=committed(0), replayed=True)
    created = await worker.create_thread(THREAD, {"n": 1})
    assert (created.thread_id, created.version, created.replayed) == (THREAD, 0, True)


def lease(state: bytes = b'{"n":1}', **fields: Any) -> transition_pb2.SubscribeWorkResponse:
    return transition_pb2.SubscribeWorkResponse(
        thread_id=THREAD, version=3, state_json=state, lease_epoch=7, **fields
    )


# Each call that turns a reply into a result: how the server answers it without a
# sub-message or oneof the protocol requires (False) or with it (True), the call, the
# ProtocolError's message, and what the whole answer's result holds.
Case = tuple[
    Callable[[Scripted, bool], None], Callable[[ZtateClient], Any], str, Callable[[Any], Any]
]
INCOMPLETE: dict[str, Case] = {
    "get_transition": (
        lambda s, whole: setattr(
            s,
            "record",
            transition_pb2.GetTransitionResponse(transition=committed(4))
            if whole
            else transition_pb2.GetTransitionResponse(),
        ),
        lambda w: w.get_transition(thread_id=THREAD, version=4),
        "the service answered GetTransition without the transition",
        lambda r: (r.version, r.committed_at.year),
    ),
    "get_record": (
        lambda s, whole: setattr(
            s,
            "record",
            transition_pb2.GetTransitionResponse(transition=committed(4), risk_rules=RULES)
            if whole
            else transition_pb2.GetTransitionResponse(risk_rules=RULES),
        ),
        lambda w: w.get_record(THREAD),
        "the service answered GetTransition without the transition",
        lambda r: (r.transition.version, r.risk_rules),
    ),
    "a record without its commit time": (
        lambda s, whole: setattr(
            s,
            "record",
            transition_pb2.GetTransitionResponse(
                transition=committed(4)
                if whole
                else transition_pb2.Transition(thread_id=THREAD, version=4, digest="f" * 64)
            ),
        ),
        lambda w: w.get_record(THREAD, version=4),
        "the service sent a Transition without the committed_at",
        lambda r: (r.transition.version, r.transition.committed_at.year),
    ),
    "propose": (
        lambda s, whole: setattr(
            s,
            "propose",
            lambda call, request: (
                transition_pb2.ProposeTransitionResponse(transition=committed(4), replayed=True)
                if whole
                else transition_pb2.ProposeTransitionResponse(replayed=True)
            ),
        ),
        lambda w: w.propose(THREAD, 3, {"n": 2}),
        "the service answered ProposeTransition without the outcome",
        lambda r: (r.version, r.replayed),
    ),
    "wait_for_outcome, committed": (
        lambda s, whole: setattr(
            s,
            "outcome",
            transition_pb2.WaitForOutcomeResponse(
                outcome=transition_pb2.OUTCOME_COMMITTED,
                transition=committed(4) if whole else None,
            ),
        ),
        lambda w: w.wait_for_outcome(f"{THREAD}/key", within=5),
        "the service answered WaitForOutcome without the transition",
        lambda r: (r.status, r.transition.version),
    ),
    "wait_for_outcome, no outcome": (
        lambda s, whole: setattr(
            s,
            "outcome",
            transition_pb2.WaitForOutcomeResponse(
                outcome=transition_pb2.OUTCOME_REJECTED if whole else None
            ),
        ),
        lambda w: w.wait_for_outcome(f"{THREAD}/key", within=5),
        "the service answered WaitForOutcome with outcome 0",
        lambda r: (r.status, r.transition),
    ),
    "renew_lease": (
        lambda s, whole: setattr(
            s,
            "renewed",
            transition_pb2.RenewLeaseResponse(lease_expires_at=stamp() if whole else None),
        ),
        lambda w: w.renew_lease(THREAD, 7),
        "the service answered RenewLease without the lease_expires_at",
        lambda r: r.year,
    ),
    "subscribe_work": (
        lambda s, whole: setattr(
            s, "work", [lease(lease_expires_at=stamp()) if whole else lease()]
        ),
        lambda w: anext(w.subscribe_work(reconnects=0)),
        "the service answered SubscribeWork without the lease_expires_at",
        lambda r: (r.version, r.lease_epoch, r.lease_expires_at.year),
    ),
}


@pytest.mark.parametrize("case", INCOMPLETE)
async def test_a_reply_without_what_the_protocol_requires_is_a_protocol_error(
    scripted: tuple[Scripted, ZtateClient], case: str
) -> None:
    """Not a result of empty fields (a Transition of version 0 committed in 1970, a
    proposal taken for committed): ProtocolError, raised at once, not retried."""
    servicer, worker = scripted
    answer, call, message, holds = INCOMPLETE[case]
    answer(servicer, False)
    with pytest.raises(ProtocolError) as failed:
        await call(worker)
    assert (failed.value.code, failed.value.reason) == (grpc.StatusCode.INTERNAL, "BAD_REPLY")
    assert str(failed.value) == f"BAD_REPLY: {message}"
    assert len(servicer.asked) + len(servicer.proposals) == 1  # not retried
    # the reply the protocol allows is the result
    answer(servicer, True)
    assert holds(await call(worker)) == WHOLE[case]


WHOLE = {
    "get_transition": (4, 2026),
    "get_record": (4, tuple(RULES)),
    "a record without its commit time": (4, 2026),
    "propose": (4, True),
    "wait_for_outcome, committed": ("committed", 4),
    "wait_for_outcome, no outcome": ("rejected", None),
    "renew_lease": 2026,
    "subscribe_work": (3, 7, 2026),
}


# JSON a field of a reply must carry as an object, as a misbehaving service or proxy
# might send it instead: the bytes, and what the ProtocolError says of the field. Each
# holds "s3cret", which the error must not repeat (state values may be secrets).
BAD_JSON: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "an empty {}"),
    "cut short": (b'{"card":"s3cret', "a {} that is not JSON"),
    "not UTF-8": (b'{"card":"s3cret\xff"}', "a {} that is not JSON"),
    "UTF-16": ('{"card":"s3cret"}'.encode("utf-16"), "a {} that is not JSON"),
    "NaN": (b'{"card":"s3cret","n":NaN}', "a {} that is not JSON"),
    "nested past the parser's recursion limit": (
        b"[" * 100_000 + b'"s3cret"',
        "a {} that is not JSON",
    ),
    "an array": (b'["s3cret"]', "a {} that is not a JSON object"),
    "a string": (b'"s3cret"', "a {} that is not a JSON object"),
    "null": (b"null", "a {} that is not a JSON object"),
}


async def worked(worker: ZtateClient) -> None:
    async for _ in worker.subscribe_work(reconnects=0):
        pass


async def watched(worker: ZtateClient) -> None:
    async for _ in worker.watch(THREAD, reconnects=0):
        pass


def watch_with(
    bad: bytes,
) -> Callable[[int, int], AsyncIterator[transition_pb2.WatchThreadResponse]]:
    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        yield event(0)
        yield event(1, bad)
        yield event(2)  # never reached: the bad message ends the stream, it is not skipped
        await forever()

    return watch


def carrying_record(bad: bytes) -> transition_pb2.GetTransitionResponse:
    return transition_pb2.GetTransitionResponse(
        transition=transition_pb2.Transition(
            thread_id=THREAD, version=4, digest="f" * 64, committed_at=stamp(), record_json=bad
        )
    )


async def record_of(worker: ZtateClient) -> Any:
    return (await worker.get_record(THREAD)).transition.record


# Each reply field that carries a JSON object: how the server sends ``bad`` in it, the
# call, the message type and field the ProtocolError names, and how often the service
# was asked (once: not retried, the stream not re-opened).
JsonCase = tuple[
    Callable[[Scripted, bytes], None], Callable[[ZtateClient], Any], str, Callable[[Scripted], Any]
]
JSON_FIELDS: dict[str, JsonCase] = {
    "get_view": (
        lambda s, bad: setattr(s, "view_state", bad),
        lambda w: w.get_view(THREAD),
        "answered GetView with {}",
        lambda s: s.view_calls,
    ),
    "watch": (
        lambda s, bad: setattr(s, "watch", watch_with(bad)),
        watched,
        "answered WatchThread with {}",
        lambda s: len(s.watch_from),
    ),
    "subscribe_work": (
        lambda s, bad: setattr(
            s, "work", [lease(lease_expires_at=stamp()), lease(bad, lease_expires_at=stamp())]
        ),
        worked,
        "answered SubscribeWork with {}",
        lambda s: len(s.asked),
    ),
    "a transition's record": (
        lambda s, bad: setattr(s, "record", carrying_record(bad)),
        record_of,
        "sent a Transition with {}",
        lambda s: len(s.asked),
    ),
}


@pytest.mark.parametrize(
    ("case", "payload"),
    [
        (case, payload)
        for case in JSON_FIELDS
        for payload in BAD_JSON
        # an empty record is the protocol's: withheld from this node (RecordWithheld)
        if (case, payload) != ("a transition's record", "empty")
    ],
)
async def test_a_reply_whose_json_is_not_an_object_is_a_protocol_error(
    scripted: tuple[Scripted, ZtateClient], case: str, payload: str
) -> None:
    """Not a decoding traceback (JSONDecodeError, UnicodeDecodeError, RecursionError)
    nor a state that is not a mapping: ProtocolError naming the field, not its bytes,
    raised at once and not retried; a stream ends with it after the whole messages
    before it, the bad one not skipped."""
    servicer, worker = scripted
    send, call, answered, asked = JSON_FIELDS[case]
    bad, fault = BAD_JSON[payload]
    field = "record_json" if case == "a transition's record" else "state_json"
    send(servicer, bad)
    with pytest.raises(ProtocolError) as failed:
        async with asyncio.timeout(10):  # a skipped message would wait for the next forever
            await call(worker)
    assert (failed.value.code, failed.value.reason) == (grpc.StatusCode.INTERNAL, "BAD_REPLY")
    assert str(failed.value) == f"BAD_REPLY: the service {answered.format(fault.format(field))}"
    assert "s3cret" not in "".join(traceback.format_exception(failed.value))
    # no parser's exception chained to it (a JSONDecodeError holds the whole document)
    assert failed.value.__cause__ is None
    assert failed.value.__context__ is None or failed.value.__suppress_context__
    assert asked(servicer) == 1


async def test_a_stream_ended_by_a_bad_message_ends_with_the_whole_ones_before_it(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.watch = watch_with(b"[]")
    servicer.work = [lease(lease_expires_at=stamp()), lease(b"[]", lease_expires_at=stamp())]
    seen: list[Any] = []

    async def watch() -> None:
        async for change in worker.watch(THREAD, reconnects=0):
            seen.append(change.version)

    async def work() -> None:
        async for item in worker.subscribe_work(reconnects=0):
            seen.append(item.state)

    for stream in (watch, work):
        with pytest.raises(ProtocolError):
            async with asyncio.timeout(10):
                await stream()
    assert seen == [0, {"n": 1}]
    assert (servicer.watch_from, servicer.asked) == ([-1], ["SubscribeWork"])


# --- the runner ---------------------------------------------------------------------------


def only(*versions: int) -> Callable[[int, int], AsyncIterator[transition_pb2.WatchThreadResponse]]:
    async def watch(call: int, after: int) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        for version in versions:
            if version > after:
                yield event(version)
        await forever()

    return watch


async def test_the_runner_reruns_its_handler_on_a_fresh_view_when_stale(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.watch = only(0)
    servicer.view_version = 1

    def propose(call: int, request: Any) -> transition_pb2.ProposeTransitionResponse:
        if call == 1:
            raise errors.StaleVersion("the head is at 1", current_version=1)
        return transition_pb2.ProposeTransitionResponse(transition=committed(2))

    servicer.propose = propose
    views: list[int] = []

    def handler(view: View) -> dict[str, Any]:
        views.append(view.version)
        return {"n": view.version + 10}

    steps = await NodeRunner(worker, THREAD, handler, node_name="planner").run(stop_after=1)
    assert views == [0, 1]
    assert [p.expected_version for p in servicer.proposals] == [0, 1]
    assert [(s.status, s.view_version, s.patch) for s in steps] == [("committed", 1, {"n": 11})]
    assert steps[0].transition is not None
    assert steps[0].transition.version == 2


async def test_the_runner_records_a_refusal_and_carries_on(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.watch = only(0, 1)

    def propose(call: int, request: Any) -> transition_pb2.ProposeTransitionResponse:
        if call == 1:
            raise errors.KeyNotWritable("outside the allowlist", keys=["target_user_id"])
        return transition_pb2.ProposeTransitionResponse(transition=committed(2))

    servicer.propose = propose
    steps = await NodeRunner(
        worker, THREAD, lambda view: {"target_user_id": "x"} if view.version == 0 else {"n": 2}
    ).run(stop_after=2)
    assert [s.status for s in steps] == ["refused", "committed"]
    assert steps[0].error is not None
    assert steps[0].error.reason == "KEY_NOT_WRITABLE"
    assert steps[0].error.keys == ("target_user_id",)
    assert steps[0].transition is None


async def test_a_reply_without_its_outcome_is_no_refusal_to_record(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    """A ProposeTransition reply with neither a transition nor a pending one is a
    ProtocolError, not a refusal: nothing was decided (the proposal may have committed),
    so the runner records no "refused" step and raises it, as it does Unavailable (on
    the lease path the lease then lapses instead of being released as handled)."""
    servicer, worker = scripted
    servicer.watch = only(0, 1)
    servicer.propose = lambda call, request: transition_pb2.ProposeTransitionResponse()
    runner = NodeRunner(worker, THREAD, lambda view: {"n": 2})
    with pytest.raises(ProtocolError):
        await runner.run(stop_after=2)
    assert runner.steps == []
    assert len(servicer.proposals) == 1  # not carried on to the next version


async def test_the_runner_waits_for_an_approval_and_skips_its_own_commit(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.watch = only(0, 1, 2)  # version 1 is its own approved commit
    servicer.propose = lambda call, request: transition_pb2.ProposeTransitionResponse(
        pending=transition_pb2.PendingTransition(
            digest="d" * 64, thread_id=THREAD, base_version=request.expected_version,
            risk_rules=["large-refund"],
        )
    )  # fmt: skip
    servicer.outcome = transition_pb2.WaitForOutcomeResponse(
        outcome=transition_pb2.OUTCOME_COMMITTED, transition=committed(1)
    )
    seen: list[int] = []
    parked: list[str] = []

    def handler(view: View) -> dict[str, Any]:
        seen.append(view.version)
        return {"n": view.version}

    runner = NodeRunner(worker, THREAD, handler, on_parked=lambda p: parked.append(p.digest))
    steps = await runner.run(stop_after=2)
    assert seen == [0, 2]
    assert parked == ["d" * 64, "d" * 64]
    assert [(s.status, s.digest) for s in steps] == [("committed", "d" * 64)] * 2


# --- verify_head_before_acting --------------------------------------------------------------


def head_with_receipt(receipt: bool = True) -> tuple[transition_pb2.GetTransitionResponse, Any]:
    signed, record, keys = approved(PATCH)
    if not receipt:
        record["receipt_digest"] = None
    record_json = canonical_bytes(record)
    response = transition_pb2.GetTransitionResponse(
        transition=transition_pb2.Transition(
            thread_id=THREAD,
            version=4,
            digest=sha256_hex(record_json),
            record_json=record_json,
            committed_at=stamp(),
        ),
        risk_rules=RULES if receipt else [],
    )
    if receipt:
        response.receipt.CopyFrom(
            approval_pb2.SignedReceipt(
                receipt_json=signed.receipt_bytes, signature=signed.signature, key_id=signed.key_id
            )
        )
    return response, keys


def signed_head(digest: str, version: int = 4) -> tuple[transition_pb2.SignedCheckpoint, Any]:
    key = Ed25519PrivateKey.generate()
    signed = sign_checkpoint(
        key, "ck1", thread_id=THREAD, version=version, head_digest=digest, signed_at=T0
    )
    return (
        transition_pb2.SignedCheckpoint(
            checkpoint_json=signed.checkpoint, signature=signed.signature, key_id="ck1"
        ),
        {"ck1": key.public_key()},
    )


async def test_an_approved_and_checkpointed_head_verifies(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.record, approval_keys = head_with_receipt()
    servicer.checkpoint, checkpoint_keys = signed_head(servicer.record.transition.digest)
    head = await verify_head_before_acting(
        worker,
        THREAD,
        approval_keys=approval_keys,
        checkpoint_keys=checkpoint_keys,
        expected_version=4,
        expected_digest=servicer.record.transition.digest,
        acting_on=PATCH,
    )
    assert (head.version, head.digest) == (4, servicer.record.transition.digest)
    assert head.receipt["reviewers"] == ["spiffe://ztate.test/reviewer/alice"]


@pytest.mark.parametrize(
    ("case", "check"),
    [
        ("no receipt", "receipt.missing"),
        ("moved", "head.moved"),
        ("another digest", "head.moved"),
        ("a key the approval did not set", "patch.missing"),
        ("another value", "patch.value"),
        ("other approval key", "receipt.signature"),
        ("checkpoint of another head", "checkpoint.head"),
        ("other checkpoint key", "checkpoint.signature"),
        ("no checkpoint", "checkpoint.missing"),
    ],
)
async def test_a_head_that_does_not_prove_its_approval_is_refused(
    scripted: tuple[Scripted, ZtateClient], case: str, check: str
) -> None:
    servicer, worker = scripted
    servicer.record, approval_keys = head_with_receipt(receipt=case != "no receipt")
    digest = servicer.record.transition.digest
    servicer.checkpoint, checkpoint_keys = signed_head(
        "0" * 64 if case == "checkpoint of another head" else digest
    )
    if case == "no checkpoint":
        servicer.checkpoint = None
    if case == "other approval key":
        approval_keys = {"approval-k1": Ed25519PrivateKey.generate().public_key()}
    if case == "other checkpoint key":
        checkpoint_keys = {"ck1": Ed25519PrivateKey.generate().public_key()}
    with pytest.raises(HeadNotVerified) as refused:
        await verify_head_before_acting(
            worker,
            THREAD,
            approval_keys=approval_keys,
            checkpoint_keys=checkpoint_keys,
            expected_version=3 if case == "moved" else 4,
            expected_digest="e" * 64 if case == "another digest" else digest,
            acting_on=ACTING_ON.get(case, PATCH),
            checkpoint_wait=0.3,
        )
    assert refused.value.check == check
    assert "75000" not in str(refused.value)  # never a value
    assert "99" not in str(refused.value)


ACTING_ON: dict[str, dict[str, Any]] = {
    "a key the approval did not set": {**PATCH, "target_user_id": "u"},
    "another value": {
        "approved_action": {"action": "refund", "order_id": "A-42", "amount_cents": 99}
    },
}


def with_record(record_json: bytes) -> transition_pb2.GetTransitionResponse:
    """The approved head's receipt, but another record body (whose digest matches)."""
    response, _ = head_with_receipt()
    response.transition.record_json = record_json
    response.transition.digest = sha256_hex(record_json)
    return response


def record_with(**changes: Any) -> bytes:
    _, record, _ = approved(PATCH)
    record.update(changes)
    return canonical_bytes({k: v for k, v in record.items() if v is not ...})


@pytest.mark.parametrize(
    ("case", "record_json"),
    [
        ("not JSON", b"{not json"),
        ("not an object", b"[1,2]"),
        ("not UTF-8", b'{"a":"\xff"}'),
        ("not canonical", b'{ "format": 1 }'),
        ("a member missing", record_with(committed_at=...)),
        ("a member too many", record_with(extra=1)),
        ("version not an integer", record_with(version="4")),
        ("patch not an object", record_with(patch=[1])),
        ("a bad timestamp", record_with(committed_at="2026-13-45T99:00:00.000000Z")),
        ("a timestamp of another form", record_with(committed_at="2026-01-02")),
        ("an integer beyond I-JSON", b'{"format":1,"n":9007199254740993}'),
        ("a fraction written as exponent", b'{"n":1E400}'),
    ],
)
async def test_a_malformed_record_is_head_not_verified_never_a_crash(
    scripted: tuple[Scripted, ZtateClient], case: str, record_json: bytes
) -> None:
    servicer, worker = scripted
    _, approval_keys = head_with_receipt()
    servicer.record = with_record(record_json)
    servicer.checkpoint, checkpoint_keys = signed_head(servicer.record.transition.digest)
    with pytest.raises(HeadNotVerified) as refused:
        await verify_head_before_acting(
            worker,
            THREAD,
            approval_keys=approval_keys,
            checkpoint_keys=checkpoint_keys,
            expected_version=4,
            acting_on=PATCH,
            checkpoint_wait=0.3,
        )
    assert refused.value.check == "record.form", case


@pytest.mark.parametrize("case", ["no transition", "no committed_at"])
async def test_a_head_reply_without_what_the_protocol_requires_is_head_not_verified(
    scripted: tuple[Scripted, ZtateClient], case: str
) -> None:
    """get_record raises ProtocolError for such a reply: the check says HeadNotVerified
    (reply.form), as for any malformed answer, and repeats nothing the reply held."""
    servicer, worker = scripted
    whole, approval_keys = head_with_receipt()
    if case == "no transition":
        whole.ClearField("transition")
    else:
        whole.transition.ClearField("committed_at")
    servicer.record = whole
    with pytest.raises(HeadNotVerified) as refused:
        await verify_head_before_acting(
            worker,
            THREAD,
            approval_keys=approval_keys,
            checkpoint_keys={},
            expected_version=4,
            acting_on=PATCH,
            checkpoint_wait=0.3,
        )
    assert (refused.value.check, str(refused.value)) == (
        "reply.form",
        "reply.form: the service answered GetTransition without a field the protocol requires",
    )
    assert refused.value.__cause__ is None
    assert refused.value.__suppress_context__
    assert servicer.asked == ["GetTransition"]  # asked once: not retried


async def test_a_checkpoint_is_not_parsed_before_its_signature_verifies(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.record, approval_keys = head_with_receipt()
    _, checkpoint_keys = signed_head(servicer.record.transition.digest)
    # garbage that is not even JSON, under a signature of nothing: refused for the
    # signature, not a parse error and not a wait for a "version" it cannot hold
    servicer.checkpoint = transition_pb2.SignedCheckpoint(
        checkpoint_json=b"\xff{", signature="ab" * 64, key_id="ck1"
    )
    with pytest.raises(HeadNotVerified) as refused:
        await verify_head_before_acting(
            worker,
            THREAD,
            approval_keys=approval_keys,
            checkpoint_keys=checkpoint_keys,
            expected_version=4,
            acting_on=PATCH,
            checkpoint_wait=30,
        )
    assert refused.value.check == "checkpoint.signature"


async def test_the_worker_must_name_what_it_acts_on(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    servicer, worker = scripted
    servicer.record, approval_keys = head_with_receipt()
    with pytest.raises(ValueError, match="acting_on"):
        await verify_head_before_acting(
            worker,
            THREAD,
            approval_keys=approval_keys,
            checkpoint_keys={},
            expected_version=4,
            acting_on={},
        )


def granted(epoch: int, version: int, expires_at: datetime) -> transition_pb2.SubscribeWorkResponse:
    at = timestamp_pb2.Timestamp()
    at.FromDatetime(expires_at)
    return transition_pb2.SubscribeWorkResponse(
        thread_id=THREAD,
        version=version,
        state_json=b'{"n":1}',
        lease_epoch=epoch,
        lease_expires_at=at,
        lease_ttl_seconds=30.0,
    )


@pytest.mark.parametrize("service_clock_ahead", [3600.0, -3600.0])
async def test_serve_drops_an_item_whose_lease_aged_on_the_way_whatever_the_clocks(
    scripted: tuple[Scripted, ZtateClient], service_clock_ahead: float
) -> None:
    """Three grants, the service's clock an hour off this machine's: the first and the
    third come as granted, the second was granted 20 s of its 30 s TTL earlier (it sat
    in a stream granted more than the runner could start). The runner judges a grant's
    age against the quickest delivery it saw, so the offset changes nothing: the young
    grants start at once, with no call; the old one is renewed first and, lost
    (LEASE_LOST), dropped: its handler never runs, and nothing is proposed or released
    for it."""
    servicer, worker = scripted
    now = datetime.now(UTC) + timedelta(seconds=service_clock_ahead)
    servicer.work = [
        granted(7, 1, now + timedelta(seconds=30)),
        granted(8, 2, now + timedelta(seconds=10)),
        granted(9, 3, now + timedelta(seconds=30)),
    ]
    servicer.renew_refusal = errors.LeaseLost("this lease is no longer held")
    ran: list[int] = []

    def handler(view: View) -> None:
        ran.append(view.version)  # nothing to do: the lease is released, handled

    runner = NodeRunner.for_node(worker, handler, node_name="db-writer", concurrency=1)
    stop = asyncio.Event()
    serving = asyncio.create_task(runner.serve(stop))
    async with asyncio.timeout(10):
        while True:
            servicer.released.clear()
            if len(servicer.releases) >= 2:
                break
            await servicer.released.wait()
    stop.set()
    assert await asyncio.wait_for(serving, 10) == []
    assert ran == [1, 3]
    assert servicer.renewals == [8]
    assert servicer.releases == [(7, 1), (9, 3)]
    assert servicer.proposals == []


async def test_serve_stopped_while_checking_an_items_lease_releases_it_undone(
    scripted: tuple[Scripted, ZtateClient],
) -> None:
    """A grant that aged on the way is being renewed before its handler starts when
    ``stop`` comes: the item was read but never started, so it is released undone
    (-1) for another process to take at once, and its handler never runs."""
    servicer, worker = scripted
    now = datetime.now(UTC)
    servicer.work = [granted(7, 1, now + timedelta(seconds=30)), granted(8, 2, now)]
    servicer.renew_gate.clear()  # the renewal of the aged grant hangs
    ran: list[int] = []

    def handler(view: View) -> None:
        ran.append(view.version)

    runner = NodeRunner.for_node(worker, handler, node_name="db-writer", concurrency=2)
    stop = asyncio.Event()
    serving = asyncio.create_task(runner.serve(stop))
    await asyncio.wait_for(servicer.renew_asked.wait(), 10)
    async with asyncio.timeout(10):  # the young grant was handled and released meanwhile
        while True:
            servicer.released.clear()
            if servicer.releases:
                break
            await servicer.released.wait()
    stop.set()
    assert await asyncio.wait_for(serving, 10) == []
    assert ran == [1]
    assert servicer.renewals == [8]
    assert servicer.releases == [(7, 1), (8, -1)]
    assert servicer.proposals == []
