"""Requests whose bytes are not the message they claim to be.

grpc.aio answers a request its deserializer cannot parse with UNKNOWN and a text
naming a Python exception class. ``RefuseUndecodable`` (a server interceptor, first
in every service's chain) swaps each method's deserializer for one that never
raises, and answers such a request INVALID_ARGUMENT (reason ``PATCH_MALFORMED``:
the bytes are malformed), before any handler or span sees it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from ztate.services.runtime import errors, rpc_errors

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


class _Undecodable:
    """What the safe deserializer returns for bytes that are not the message."""


UNDECODABLE = _Undecodable()


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError):
            return UNDECODABLE

    return parse


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
    name = method.rsplit("/", 1)[-1]
    status = rpc_errors.to_status(
        errors.PatchMalformed(f"the {name} request is not a valid protobuf message")
    )
    await context.abort(status.code, status.details, status.trailing_metadata)


def _guard_unary(method: str, behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if request is UNDECODABLE:
            await _refuse(context, method)
        return await behaviour(request, context)

    return guarded


def _guard_stream(method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def guarded(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if request is UNDECODABLE:
            await _refuse(context, method)
        async for reply in behaviour(request, context):
            yield reply

    return guarded


class RefuseUndecodable(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Undecodable request bytes are INVALID_ARGUMENT, never UNKNOWN (see module doc).

    The guarded handler of a method is built once and kept while the service hands out
    the same handler for it (it does: the servicer's handlers are built at start-up),
    so that a call costs a dictionary look-up, not three closures and a namedtuple."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        method = details.method
        kept = self._guarded.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        guarded = _guarded_handler(method, handler)
        if handler is not None and len(self._guarded) < MAX_KEPT_HANDLERS:
            self._guarded[method] = (handler, guarded)
        return guarded


MAX_KEPT_HANDLERS = 256  # more than the services' methods; unknown names are not kept


def _guarded_handler(method: str, handler: Handler) -> Handler:
    if handler is None or handler.request_streaming:
        return handler  # no ztate method streams requests
    if handler.unary_unary is not None:
        return handler._replace(  # type: ignore[attr-defined, no-any-return]
            request_deserializer=_safe(handler.request_deserializer),
            unary_unary=_guard_unary(method, handler.unary_unary),
        )
    if handler.unary_stream is not None:
        return handler._replace(  # type: ignore[attr-defined, no-any-return]
            request_deserializer=_safe(handler.request_deserializer),
            unary_stream=_guard_stream(method, handler.unary_stream),
        )
    return handler
