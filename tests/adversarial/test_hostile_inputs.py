"""Inputs that once produced INTERNAL or UNKNOWN, each with its precise answer now.

U+0000 is valid JSON and I-JSON (RFC 8785's own test data holds it) that PostgreSQL's
jsonb and text cannot store: it is refused at the door with UNSUPPORTED_CHARACTER, and
the refusal itself is always recorded (the row holds it written as ``\\u0000``).
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import timestamp_pb2

from tests.harness import INITIAL, Ledger, Pki, client, new_thread_id, secure_channel
from ztate.contract.canonical import hashed_name
from ztate.v1 import ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import InvalidRequest


async def new_thread(target: str, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


@pytest.mark.parametrize(
    "patch",
    [
        b'{"requested_action": {"action": "refund", "order_id": "A-1\\u0000"}}',
        b'{"requested_action": {"act\\u0000ion": "refund"}}',
        b'{"requested\\u0000action": 1}',
    ],
)
async def test_a_nul_in_a_patch_is_refused_at_the_door_and_recorded(
    target: str, pki: Pki, ledger: Ledger, patch: bytes
) -> None:
    thread_id = await new_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.node("input-parser")) as parser:
        with pytest.raises(InvalidRequest) as refused:
            await parser.propose(thread_id, 0, patch)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.reason == "UNSUPPORTED_CHARACTER"
    assert await ledger.snapshot(thread_id) == before  # nothing committed
    [row] = await ledger.rejections(thread_id)
    assert row["reason"] == "UNSUPPORTED_CHARACTER"
    assert row["keys"] == []  # refused before any key was looked at


async def test_a_risky_proposal_holding_a_nul_is_never_parked(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """Before: parked, approved, and then never committed (delivery retried forever)."""
    thread_id = await new_thread(target, pki)
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(InvalidRequest) as refused:
            await planner.propose(thread_id, 0, b'{"target_user_id": "x\\u0000"}')
    assert refused.value.reason == "UNSUPPORTED_CHARACTER"
    conn_rows = await ledger.rejections(thread_id)
    assert [r["reason"] for r in conn_rows] == ["UNSUPPORTED_CHARACTER"]
    assert (await ledger.snapshot(thread_id)).head_version == 0


async def test_a_nul_in_an_initial_state_is_refused(target: str, pki: Pki) -> None:
    async with client(target, pki.operator()) as operator:
        with pytest.raises(InvalidRequest) as refused:
            await operator.create_thread(
                new_thread_id(), {**INITIAL, "raw_text": "a\x00b"}, policy="pipeline"
            )
    assert refused.value.reason == "UNSUPPORTED_CHARACTER"


async def test_a_nul_in_a_thread_id_is_refused_and_the_refusal_recorded(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """Before: the rejection row itself could not be written (INTERNAL, no row)."""
    before = await ledger.rejection_count()
    async with secure_channel(target, pki.node("input-parser")) as opened:
        stub = transition_pb2_grpc.TransitionServiceStub(opened)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ProposeTransition(
                transition_pb2.ProposeTransitionRequest(
                    thread_id="t-1\x00; DROP",
                    expected_version=0,
                    patch_json=b"{}",
                    idempotency_key="k-1",
                )
            )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert await ledger.rejection_count() == before + 1
    # recorded by its hash: an id refused before it was checked is never stored as sent
    conn_rows = await ledger.rejections(hashed_name("t-1\x00; DROP"))
    assert [r["reason"] for r in conn_rows] == ["REQUEST_INVALID"]


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(2**62, 0), (-(2**62), 0), (253_402_300_800, 0), (0, -1), (0, 10**9)],
)
async def test_timestamps_out_of_range_are_invalid_arguments(
    target: str, pki: Pki, seconds: int, nanos: int
) -> None:
    stamp = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    async with secure_channel(target, pki.operator()) as opened:
        stub = ledger_pb2_grpc.LedgerServiceStub(opened)
        for call in (
            stub.ListRejections(ledger_pb2.ListRejectionsRequest(since=stamp)),
            stub.ListTransitions(ledger_pb2.ListTransitionsRequest(until=stamp)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "timestamp between 0001-01-01 and 9999-12-31" in (refused.value.details() or "")


@pytest.mark.parametrize("token", ["²", "١٢", "99999999999999999999", "9223372036854775808"])
async def test_page_tokens_this_service_never_issued_are_invalid(
    target: str, pki: Pki, token: str
) -> None:
    async with secure_channel(target, pki.operator()) as opened:
        stub = ledger_pb2_grpc.LedgerServiceStub(opened)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListRejections(ledger_pb2.ListRejectionsRequest(page_token=token))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "page_token is not one this service issued"


@pytest.mark.parametrize(
    "method",
    [
        "/ztate.v1.TransitionService/ProposeTransition",
        "/ztate.v1.TransitionService/WatchThread",
        "/ztate.v1.LedgerService/ListTransitions",
        "/grpc.health.v1.Health/Check",
    ],
)
async def test_undecodable_request_bytes_are_invalid_argument_naming_no_exception(
    target: str, pki: Pki, method: str
) -> None:
    async with secure_channel(target, pki.node("input-parser")) as opened:
        raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}

        async def send() -> None:
            if method.endswith("WatchThread"):
                async for _ in opened.unary_stream(method, **raw)(b"\xff\xff\xff", timeout=5):
                    pass
            else:
                await opened.unary_unary(method, **raw)(b"\xff\xff\xff", timeout=5)

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await send()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    name = method.rsplit("/", 1)[1]
    assert refused.value.details() == f"the {name} request is not a valid protobuf message"
