"""The Python SDK for ztate agent workers.

A worker holds only its own certificate and key and the CA certificate. It
imports no database driver and no server code: it can read its view, watch its
thread, propose patches, and check with public keys that a head was approved.

* ``ZtateClient`` (asyncio) and ``SyncZtateClient`` (blocking): the calls.
* ``NodeRunner`` / ``run_node``: a node as a function from its view to a patch,
  driven by the thread's changes; ``NodeRunner.for_node(...).serve()`` serves all of
  the node's work (``SubscribeWork``, under leases), ``concurrency`` at a time (its
  options, and ``SyncZtateClient.serve``'s: ``ServeOptions``).
* ``verify_head_before_acting``: a privileged worker's check, immediately before
  it acts, of the head's approval receipt and checkpoint (``VerifiedHead``, or
  ``HeadNotVerified``).
* One exception type per refusal (``StaleVersion``, ``PermissionDenied``, ...), and
  ``ProtocolError`` for an answer the protocol does not allow.
"""

from ztate.contract.keyring import load_public_keys
from ztate.worker_sdk._runner import Handler, NodeRunner, ServeOptions, Step, run_node
from ztate.worker_sdk._verify import HeadNotVerified, VerifiedHead, verify_head_before_acting
from ztate.worker_sdk.client import (
    Checkpoint,
    HeadRecord,
    Outcome,
    Receipt,
    Transition,
    View,
    WatchEvent,
    WorkItem,
    ZtateClient,
    encode_json,
)
from ztate.worker_sdk.errors import (
    AlreadyExists,
    AwaitingApproval,
    CertificateExpired,
    FailedPrecondition,
    HandshakeFailed,
    IdentityRevoked,
    InvalidRequest,
    InvariantViolated,
    LeaseLost,
    MessageTooLarge,
    NotFound,
    PatchTooLarge,
    PermissionDenied,
    ProtocolError,
    QueryTooCostly,
    RecordWithheld,
    ResourceExhausted,
    StaleVersion,
    StateTooLarge,
    TooManyStreams,
    Unauthenticated,
    Unavailable,
    Unreachable,
    ZtateError,
)
from ztate.worker_sdk.sync import SyncZtateClient

__all__ = [
    "AlreadyExists",
    "AwaitingApproval",
    "CertificateExpired",
    "Checkpoint",
    "FailedPrecondition",
    "Handler",
    "HandshakeFailed",
    "HeadNotVerified",
    "HeadRecord",
    "IdentityRevoked",
    "InvalidRequest",
    "InvariantViolated",
    "LeaseLost",
    "MessageTooLarge",
    "NodeRunner",
    "NotFound",
    "Outcome",
    "PatchTooLarge",
    "PermissionDenied",
    "ProtocolError",
    "QueryTooCostly",
    "Receipt",
    "RecordWithheld",
    "ResourceExhausted",
    "ServeOptions",
    "StaleVersion",
    "StateTooLarge",
    "Step",
    "SyncZtateClient",
    "TooManyStreams",
    "Transition",
    "Unauthenticated",
    "Unavailable",
    "Unreachable",
    "VerifiedHead",
    "View",
    "WatchEvent",
    "WorkItem",
    "ZtateClient",
    "ZtateError",
    "encode_json",
    "load_public_keys",
    "run_node",
    "verify_head_before_acting",
]
