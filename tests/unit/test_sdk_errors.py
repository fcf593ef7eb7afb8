"""Each server refusal becomes the SDK's typed exception, with the server's details,
through the one mapping the server uses (ztate.services.runtime.rpc_errors)."""

from __future__ import annotations

import grpc
import pytest

from ztate.services.runtime import errors, rpc_errors
from ztate.worker_sdk import (
    FailedPrecondition,
    IdentityRevoked,
    InvalidRequest,
    InvariantViolated,
    NotFound,
    PatchTooLarge,
    PermissionDenied,
    StaleVersion,
    TooManyStreams,
    Unauthenticated,
    Unavailable,
    ZtateError,
)
from ztate.worker_sdk.errors import from_rpc_error


def as_rpc_error(error: errors.ZtateError) -> grpc.aio.AioRpcError:
    status = rpc_errors.to_status(error)
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        details=status.details,
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.IdentityInvalid("no SPIFFE ID"), Unauthenticated),
        (errors.IdentityRevoked("revoked"), IdentityRevoked),
        (errors.KeyNotWritable("outside", keys=["b", "a"]), PermissionDenied),
        (errors.SchemaViolation("type", keys=["amount"]), InvalidRequest),
        (errors.PatchTooLarge("big", limit=4096), PatchTooLarge),
        (errors.StaleVersion("moved", current_version=7), StaleVersion),
        (errors.ThreadNotFound("no such thread"), NotFound),
        (errors.InvariantViolated("broken", rules=["the-plan"]), InvariantViolated),
        (errors.ReviewClosed("closed"), FailedPrecondition),
        (errors.TooManyStreams("full", limit=256), TooManyStreams),
        (errors.StorageUnavailable("down"), Unavailable),
    ],
)
def test_each_refusal_becomes_its_typed_exception_with_details(
    error: errors.ZtateError, expected: type[ZtateError]
) -> None:
    typed = from_rpc_error(as_rpc_error(error))
    assert type(typed) is expected
    assert typed.reason == error.reason
    assert typed.message == error.message
    assert typed.code is rpc_errors.STATUS_OF[type(error)]
    assert typed.keys == error.keys
    assert typed.rules == error.rules
    assert typed.limit == error.limit
    assert typed.current_version == error.current_version


def test_a_status_without_details_keeps_its_code_as_reason() -> None:
    bare = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone"
    )
    typed = from_rpc_error(bare)
    assert type(typed) is Unavailable
    assert (typed.reason, typed.message) == ("UNAVAILABLE", "gone")
