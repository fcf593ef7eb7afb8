"""The Python SDK for ztate agent workers.

A worker holds only its own certificate and key and the CA certificate. It
imports no database driver and no server code: it can read its view and propose
patches, nothing more.
"""

from worker_sdk.client import Outcome, Transition, View, ZtateClient, encode_json
from worker_sdk.errors import (
    AlreadyExists,
    AwaitingApproval,
    FailedPrecondition,
    InvalidRequest,
    InvariantViolated,
    NotFound,
    PatchTooLarge,
    PermissionDenied,
    StaleVersion,
    Unauthenticated,
    Unavailable,
    ZtateError,
)
from worker_sdk.sync import SyncZtateClient

__all__ = [
    "AlreadyExists",
    "AwaitingApproval",
    "FailedPrecondition",
    "InvalidRequest",
    "InvariantViolated",
    "NotFound",
    "Outcome",
    "PatchTooLarge",
    "PermissionDenied",
    "StaleVersion",
    "SyncZtateClient",
    "Transition",
    "Unauthenticated",
    "Unavailable",
    "View",
    "ZtateClient",
    "ZtateError",
    "encode_json",
]
