"""Domain errors, the proto's ErrorReason enum and the status mapping stay in step."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from ztate.services.runtime import errors, rpc_errors
from ztate.v1 import errors_pb2


def test_every_domain_error_has_a_proto_reason_and_the_reverse() -> None:
    domain = {cls.reason for cls in errors.ALL_ERRORS}
    proto = {
        name.removeprefix("ERROR_REASON_")
        for name in errors_pb2.ErrorReason.keys()  # noqa: SIM118 - an enum wrapper, not a dict
        if name != "ERROR_REASON_UNSPECIFIED"
    }
    assert domain == proto
    assert len(domain) == len(errors.ALL_ERRORS)  # one reason per type


def test_every_domain_error_maps_to_one_status() -> None:
    assert set(rpc_errors.STATUS_OF) == set(errors.ALL_ERRORS)


def test_status_carries_reason_and_typed_detail() -> None:
    status = rpc_errors.to_status(errors.StaleVersion("expected 3, head at 5", current_version=5))
    assert status.code == grpc.StatusCode.ABORTED
    [(key, value)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    rich = status_pb2.Status.FromString(value)
    info, detail = error_details_pb2.ErrorInfo(), errors_pb2.ErrorDetail()
    assert rich.details[0].Unpack(info)
    assert rich.details[1].Unpack(detail)
    assert (info.reason, info.domain) == ("STALE_VERSION", "ztate.dev")
    assert detail.reason == errors_pb2.ERROR_REASON_STALE_VERSION
    assert detail.current_version == 5


def test_internal_status_says_nothing() -> None:
    status = rpc_errors.internal_status()
    assert (status.code, status.details) == (grpc.StatusCode.INTERNAL, "internal error")
