"""Every RPC of every service, fed hostile requests: never INTERNAL or UNKNOWN.

Requests are generated from the messages' own descriptors (so a new field is fuzzed
without touching this file): strings with U+0000, controls and long runs; bytes that
are JSON with U+0000, numbers outside I-JSON, deep nesting, or not UTF-8 at all;
integers at the int64 edges; timestamps outside any calendar. They are sent by nodes,
an operator, a reviewer and the approval service, over real mTLS. Raw bytes that are
no protobuf message at all go to every method too. For each answer: no INTERNAL, no
UNKNOWN; a refused proposal leaves exactly one rejection row and commits nothing; at
the end the thread under fire still verifies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Ledger,
    Pki,
    client,
    new_thread_id,
    secure_channel,
)
from ztate.approval_service.app import RunningApproval
from ztate.approval_service.app import start as start_approval
from ztate.contract.keyring import generate_signing_key
from ztate.services.cli import ca
from ztate.services.runtime.config import ApprovalSettings
from ztate.services.runtime.identity import Identity, Role
from ztate.v1 import approval_pb2, ledger_pb2, transition_pb2

FORBIDDEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
INT64 = (-(2**63), 2**63 - 1)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", "\x00", "t-1\x00", "t\n", "../x", "a" * 300, "²", "%s%n", "'; DROP TABLE x; --"]
    ),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8).map(
        lambda s: s + "\x00" + s
    ),
)
JSON_BYTES = st.one_of(
    st.sampled_from(
        [
            b"{}",
            b'{"requested_action": {"action": "refund", "order_id": "A-1\\u0000"}}',
            b'{"a\\u0000b": 1}',
            b'{"requested_action": 1e400}',
            b'{"requested_action": 9007199254740993}',
            b'{"requested_action": "\\ud800"}',
            b"[" * 200 + b"]" * 200,
            b'{"x": ' * 100 + b"1" + b"}" * 100,
            b"\xff\xfe{}",
            b'{"requested_action": null}',
            b'{"raw_text": "\\u0000"}',
        ]
    ),
    st.binary(max_size=64),
)
SERVICES = {
    "ztate.v1.TransitionService": transition_pb2,
    "ztate.v1.LedgerService": ledger_pb2,
    "ztate.v1.ApprovalService": approval_pb2,
    "grpc.health.v1.Health": health_pb2,
}


def message_strategy(
    descriptor: pb_descriptor.Descriptor, cls: type[pb_message.Message], depth: int = 0
) -> st.SearchStrategy[pb_message.Message]:
    """Any instance of ``cls``, each field hostile by its type."""
    fields = []
    for field in descriptor.fields:
        value = field_strategy(field, depth)
        if value is not None:
            fields.append(st.tuples(st.just(field), value))

    def build(chosen: list[tuple[pb_descriptor.FieldDescriptor, Any]]) -> pb_message.Message:
        message = cls()
        for field, value in chosen:
            if field.is_repeated:
                target = getattr(message, field.name)
                if field.message_type is not None:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.message_type is not None:
                getattr(message, field.name).CopyFrom(value)
            else:
                setattr(message, field.name, value)
        return message

    return (
        st.lists(st.one_of(fields), max_size=len(fields)).map(build) if fields else st.just(cls())
    )


def field_strategy(field: pb_descriptor.FieldDescriptor, depth: int) -> Any:
    kind = field.type
    if field.message_type is not None:
        if depth > 2:
            return None
        nested = message_strategy(field.message_type, field.message_type._concrete_class, depth + 1)
        if field.message_type.full_name == "google.protobuf.Timestamp":
            nested = st.builds(
                lambda s, n: _timestamp(s, n),
                st.integers(*INT64),
                st.integers(-(2**31), 2**31 - 1),
            )
        single: Any = nested
    elif kind == field.TYPE_STRING:
        single = HOSTILE_TEXT
    elif kind == field.TYPE_BYTES:
        single = JSON_BYTES
    elif kind in (field.TYPE_INT64, field.TYPE_SINT64, field.TYPE_SFIXED64):
        single = st.one_of(st.integers(*INT64), st.integers(-2, 5))
    elif kind in (field.TYPE_INT32, field.TYPE_ENUM, field.TYPE_SINT32):
        single = st.integers(-(2**31), 2**31 - 1)
    elif kind == field.TYPE_BOOL:
        single = st.booleans()
    else:
        return None
    if field.is_repeated:
        return st.lists(single, max_size=4)
    return single


def _timestamp(seconds: int, nanos: int) -> Any:
    from google.protobuf import timestamp_pb2

    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def methods() -> list[tuple[str, str, Any, Any, bool]]:
    """(service, method, request class, response class, server streaming) of every RPC."""
    found = []
    for service_name, module in SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[1]]
        for method in service.methods:
            found.append(
                (
                    service_name,
                    method.name,
                    method.input_type._concrete_class,
                    method.output_type._concrete_class,
                    method.server_streaming,
                )
            )
    return found


METHODS = methods()
(PROPOSE,) = [m for m in METHODS if m[1] == "ProposeTransition"]


@pytest_asyncio.fixture(scope="module")
async def approval(
    pki: Pki, database_dsn: str, target: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningApproval]:
    root = tmp_path_factory.mktemp("fuzz-approval")
    ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        root,
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    generate_signing_key(root / "signing-key.pem", root / "public.json", "approval-k1")
    running = await start_approval(
        ApprovalSettings(
            home=root,
            listen="127.0.0.1:0",
            trust_domain=TRUST_DOMAIN,
            tls_cert=root / "service-approval.crt",
            tls_key=root / "service-approval.key",
            tls_ca=pki.certs / "ca.crt",
            signing_key_file=root / "signing-key.pem",
            transition_target=target,
            db_pool_size=2,
        ),
        dsn=database_dsn,
    )
    yield running
    await running.stop(grace=1.0)


async def test_no_hostile_request_gets_internal_or_unknown(
    target: str, approval: RunningApproval, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    callers = {
        "input-parser": pki.node("input-parser"),
        "planner": pki.node("planner"),
        "operator": pki.operator(),
        "reviewer": pki.identity(Role.REVIEWER, "alice"),
        "approval": pki.identity(Role.SERVICE, "approval"),
    }
    targets = {
        "ztate.v1.ApprovalService": f"localhost:{approval.port}",
    }
    loop = asyncio.get_running_loop()
    seen: dict[str, int] = {}
    async with AsyncExitStack() as stack:
        channels = {
            (name, where): await stack.enter_async_context(secure_channel(where, creds))
            for name, creds in callers.items()
            for where in {target, *targets.values()}
        }

        async def send(caller: str, spec: tuple[Any, ...], request: Any, raw: bool) -> None:
            service, method, request_cls, response_cls, streaming = spec
            where = targets.get(service, target)
            path = f"/{service}/{method}"
            opened = channels[(caller, where)]
            serialize = (lambda b: b) if raw else request_cls.SerializeToString
            aimed = isinstance(request, transition_pb2.ProposeTransitionRequest)
            if aimed and (request.thread_id == "" or len(request.thread_id) > 20):
                request.thread_id = thread_id  # mostly aim at the real thread
            rows_before = await ledger.rejection_count()
            head_before = await ledger.snapshot(thread_id)
            code = grpc.StatusCode.OK
            try:
                if streaming:
                    call = opened.unary_stream(
                        path,
                        request_serializer=serialize,
                        response_deserializer=response_cls.FromString,
                    )(request, timeout=5)
                    async for _ in call:
                        break
                    call.cancel()
                else:
                    await opened.unary_unary(
                        path,
                        request_serializer=serialize,
                        response_deserializer=response_cls.FromString,
                    )(request, timeout=5)
            except grpc.aio.AioRpcError as refused:
                code, details = refused.code(), refused.details() or ""
            else:
                details = ""
            assert code not in FORBIDDEN, (path, caller, request, details)
            assert "Error" not in details, details  # no Python exception named
            seen[code.name] = seen.get(code.name, 0) + 1
            # bytes that are no ProposeTransitionRequest are refused before they are a
            # proposal (PATCH_MALFORMED, docs/api.md): only proposals leave rows
            if method == "ProposeTransition" and code is not grpc.StatusCode.OK and not raw:
                if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    assert await ledger.rejection_count() == rows_before + 1, (request, code)
                after = await ledger.snapshot(thread_id)
                assert after.head_version == head_before.head_version

        @settings(
            max_examples=700,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            # proposals are where hostile agents live: a third of the draws
            spec = data.draw(st.sampled_from(METHODS) | st.just(PROPOSE), label="method")
            caller = data.draw(st.sampled_from(sorted(callers)), label="caller")
            raw = data.draw(st.booleans().map(lambda b: b and data.draw(st.booleans())))
            if raw:
                request: Any = data.draw(st.binary(min_size=1, max_size=48), label="bytes")
            else:
                request_cls = spec[2]
                request = data.draw(
                    message_strategy(request_cls.DESCRIPTOR, request_cls), label="request"
                )
            asyncio.run_coroutine_threadsafe(send(caller, spec, request, raw), loop).result(60)

        await asyncio.to_thread(check)
    assert await ledger.verify(thread_id) >= 1
    # the run reached past the door: refusals of several kinds, and some successes
    assert seen.get("OK", 0) > 0, seen
    assert seen.get("INVALID_ARGUMENT", 0) > 0, seen


def test_every_rpc_is_fuzzed() -> None:
    names = {f"{service}/{method}" for service, method, *_ in METHODS}
    assert "ztate.v1.TransitionService/ProposeTransition" in names
    assert "ztate.v1.LedgerService/ListRejections" in names
    assert "ztate.v1.ApprovalService/Decide" in names
    assert len(names) == sum(
        len(module.DESCRIPTOR.services_by_name[name.rsplit(".", 1)[1]].methods)
        for name, module in SERVICES.items()
    )
