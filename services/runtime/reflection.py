"""Server reflection under both of its names: ``grpc.reflection.v1`` and ``v1alpha``.

grpcurl, Postman and buf curl ask for ``grpc.reflection.v1.ServerReflection`` first;
older clients ask for ``v1alpha``. grpcio-reflection implements only ``v1alpha``, but
the two protocols are the same messages with the same field numbers in another
package (grpc/grpc-proto, reflection/v1/reflection.proto), so one servicer answers
both: the ``v1`` method decodes its requests and encodes its replies with the
``v1alpha`` classes, which read and write the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Iterable[str], server: aio.Server) -> None:
    """Serve reflection for ``service_names`` (and itself) as v1 and v1alpha."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    # the types-grpcio-reflection stubs do not declare the asyncio servicer
    servicer = reflection.aio.ReflectionServicer(names)  # type: ignore[attr-defined]
    reflection.enable_server_reflection(names, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
