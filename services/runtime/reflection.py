"""Server reflection under both of its names: ``grpc.reflection.v1`` and ``v1alpha``.

grpcurl, Postman and buf curl ask for ``grpc.reflection.v1.ServerReflection`` first;
older clients ask for ``v1alpha``. grpcio-reflection implements only ``v1alpha``, but
the two protocols are the same messages with the same field numbers in another
package (grpc/grpc-proto, reflection/v1/reflection.proto), so one servicer answers
both: the ``v1`` method decodes its requests and encodes its replies with the
``v1alpha`` classes, which read and write the same bytes.

The file descriptors it serves carry the protos' comments: the generated Python code
keeps none (protoc leaves ``source_code_info`` out of it), so every ztate file is
answered from ``ztate/v1/descriptors.binpb``, the descriptor set ``make proto``
writes with ``--include_source_info`` beside the generated code (``make proto-check``
fails when it is stale). grpcurl ``describe`` and Postman then show each message's and
field's documentation.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


DESCRIPTOR_SET = "descriptors.binpb"


@cache
def documented_files() -> dict[str, bytes]:
    """Each file of the committed descriptor set, serialized with its comments, by name."""
    raw = resources.files("ztate.v1").joinpath(DESCRIPTOR_SET).read_bytes()
    found = descriptor_pb2.FileDescriptorSet.FromString(raw)
    return {file.name: file.SerializeToString() for file in found.file}


def _documented(reply: Any) -> Any:
    """``reply`` with each file descriptor the set holds replaced by its documented form."""
    if reply.HasField("file_descriptor_response"):
        files = reply.file_descriptor_response.file_descriptor_proto
        documented = documented_files()
        for index, raw in enumerate(files):
            name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
            files[index] = documented.get(name, raw)
    return reply


# the types-grpcio-reflection stubs do not declare the asyncio servicer
class _DocumentedServicer(reflection.aio.ReflectionServicer):  # type: ignore[name-defined,misc]
    """grpcio-reflection's servicer, answering file requests with documented files."""

    def _file_by_filename(self, request: Any, filename: str) -> Any:
        return _documented(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request: Any, symbol: str) -> Any:
        return _documented(super()._file_containing_symbol(request, symbol))

    def _file_containing_extension(self, request: Any, name: str, number: int) -> Any:
        return _documented(super()._file_containing_extension(request, name, number))


def enable_reflection(service_names: Iterable[str], server: aio.Server) -> None:
    """Serve reflection for ``service_names`` (and itself) as v1 and v1alpha."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    documented_files()  # a missing or corrupt descriptor set fails the start, not a call
    servicer = _DocumentedServicer(names)
    for name in (reflection.SERVICE_NAME, V1_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    name,
                    {
                        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                            servicer.ServerReflectionInfo,
                            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                        )
                    },
                ),
            )
        )
