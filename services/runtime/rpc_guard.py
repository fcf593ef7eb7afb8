"""Authentication and error mapping around every RPC handler.

``guarded`` takes the caller's identity from the verified client certificate,
refuses it if revoked (``identity.Authenticator``, at every call), runs the handler,
and turns domain errors into rich gRPC statuses through
``ztate.services.runtime.rpc_errors``, the one mapping. Failures nobody foresaw become a bare
INTERNAL status: the caller never sees internals, the log does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ztate.services.runtime import errors, rpc_errors
from ztate.services.runtime.identity import Authenticator, Identity
from ztate.services.runtime.outage import STORAGE_ERRORS, settled
from ztate.services.runtime.telemetry import note_caller, note_refusal

log = logging.getLogger("ztate.rpc")
Response = TypeVar("Response")
Context = grpc.aio.ServicerContext[Any, Any]
# told of a caller whose genuine certificate no longer counts (revoked, or expired)
Disowned = errors.IdentityRevoked | errors.CertificateExpired
OnRevoked = Callable[[Identity, Disowned], Awaitable[None]]


async def guarded(
    context: Context,
    authenticator: Authenticator,
    method: str,
    handler: Callable[[Identity], Awaitable[Response]],
    *,
    on_revoked: OnRevoked | None = None,
) -> Response:
    """Run ``handler`` for the authenticated caller, or abort with the right status.

    A caller whose certificate expired, or whose certificate or identity is revoked, is
    refused before ``handler`` runs; ``on_revoked`` (a proposal's rejection row) is told
    first. The current span (when tracing) is told the caller's
    SPIFFE ID and, when the call is refused, the reason code: never the refusal's message.
    """
    try:
        auth = context.auth_context()  # built anew at every ask: once per call
        caller = authenticator.identify(context, auth)
        note_caller(caller.spiffe_id)
        try:
            authenticator.check_credential(context, caller, auth)
        except (errors.IdentityRevoked, errors.CertificateExpired) as revoked:
            if on_revoked is not None:
                await on_revoked(caller, revoked)
            raise
        return await settled(handler(caller))  # an idle connection's loss is storage's
    except Exception as failure:
        status = failure_status(method, failure)
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")


def failure_status(method: str, failure: Exception) -> grpc.Status:
    """What a failed call is answered with, logged here for every handler and stream.

    A refusal keeps its reason and message (they are the caller's to see); a
    database that does not answer is UNAVAILABLE; anything else is a bare INTERNAL
    whose text (which may hold state values) never reaches the caller.
    """
    if isinstance(failure, errors.ZtateError):
        log.info("refused %s: %s", method, failure.reason)
        note_refusal(failure.reason)
        return rpc_errors.to_status(failure)
    if isinstance(failure, STORAGE_ERRORS):
        log.warning("%s: database unavailable: %s", method, type(failure).__name__)
        unavailable = errors.StorageUnavailable("the ledger database is unavailable; retry")
        note_refusal(unavailable.reason)
        return rpc_errors.to_status(unavailable)
    # the traceback goes to the service's own stderr; exported log records keep
    # only the exception's type (ztate.services.runtime.telemetry redacts them)
    log.error("%s failed unexpectedly: %s", method, type(failure).__name__, exc_info=failure)
    note_refusal("UNSPECIFIED")
    return rpc_errors.internal_status()
