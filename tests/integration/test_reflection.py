"""Server reflection answers under grpc.reflection.v1 (what grpcurl and buf curl ask for
first) as well as v1alpha, with the ztate services and the descriptors of their files."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from tests.harness import Pki, secure_channel


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
async def test_reflection_lists_the_services_and_their_files(
    target: str, pki: Pki, package: str
) -> None:
    # v1 and v1alpha messages are the same bytes (only the package differs)
    async with secure_channel(target, pki.node("input-parser")) as channel:
        call = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="ztate.v1.TransitionService"
            ),
        ]
        listed, files = [reply async for reply in call(iter(requests), timeout=10)]
    names = {service.name for service in listed.list_services_response.service}
    assert {
        "ztate.v1.TransitionService",
        "ztate.v1.LedgerService",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in files.file_descriptor_response.file_descriptor_proto
    ]
    assert "ztate/v1/transition.proto" in {proto.name for proto in protos}
    assert not any(reply.HasField("error_response") for reply in (listed, files))


def comment_of(proto: descriptor_pb2.FileDescriptorProto, message: str, field: str) -> str:
    """The leading comment of ``message.field`` in ``proto``'s source info."""
    m = [t.name for t in proto.message_type].index(message)
    f = [x.name for x in proto.message_type[m].field].index(field)
    path = [4, m, 2, f]  # FileDescriptorProto.message_type, DescriptorProto.field
    (found,) = [loc for loc in proto.source_code_info.location if list(loc.path) == path]
    return str(found.leading_comments)


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
async def test_reflected_descriptors_carry_the_protos_comments(
    target: str, pki: Pki, package: str
) -> None:
    """What grpcurl `describe` shows: each field's documentation, from the service."""
    async with secure_channel(target, pki.node("input-parser")) as channel:
        call = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="ztate.v1.ProposeTransitionRequest"
            ),
            reflection_pb2.ServerReflectionRequest(file_by_filename="ztate/v1/errors.proto"),
        ]
        by_symbol, by_name = [reply async for reply in call(iter(requests), timeout=10)]
    protos = {
        proto.name: proto
        for reply in (by_symbol, by_name)
        for proto in map(
            descriptor_pb2.FileDescriptorProto.FromString,
            reply.file_descriptor_response.file_descriptor_proto,
        )
    }
    transition = protos["ztate/v1/transition.proto"]
    assert comment_of(transition, "ProposeTransitionRequest", "idempotency_key") == (
        " Required. Unique per (thread, node) request; a retry with the same key\n"
        " returns the original outcome. 1-128 printable ASCII characters.\n"
    )
    assert comment_of(protos["ztate/v1/errors.proto"], "ErrorDetail", "keys")
    # its imports are served too, with their comments (google.api.field_behavior)
    assert protos["google/api/field_behavior.proto"].source_code_info.location
