import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ztate.v1 import approval_pb2 as _approval_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_PENDING: _ClassVar[Outcome]
    OUTCOME_COMMITTED: _ClassVar[Outcome]
    OUTCOME_REJECTED: _ClassVar[Outcome]
    OUTCOME_EXPIRED: _ClassVar[Outcome]
    OUTCOME_STALE: _ClassVar[Outcome]
    OUTCOME_REFUSED: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_PENDING: Outcome
OUTCOME_COMMITTED: Outcome
OUTCOME_REJECTED: Outcome
OUTCOME_EXPIRED: Outcome
OUTCOME_STALE: Outcome
OUTCOME_REFUSED: Outcome

class SubscribeWorkRequest(_message.Message):
    __slots__ = ("max_in_flight",)
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    max_in_flight: int
    def __init__(self, max_in_flight: _Optional[int] = ...) -> None: ...

class SubscribeWorkResponse(_message.Message):
    __slots__ = ("thread_id", "version", "state_json", "lease_epoch", "lease_expires_at", "lease_ttl_seconds", "head_digest")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    state_json: bytes
    lease_epoch: int
    lease_expires_at: _timestamp_pb2.Timestamp
    lease_ttl_seconds: float
    head_digest: str
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ..., state_json: _Optional[bytes] = ..., lease_epoch: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_ttl_seconds: _Optional[float] = ..., head_digest: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("thread_id", "lease_epoch")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    lease_epoch: int
    def __init__(self, thread_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_at",)
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("thread_id", "lease_epoch", "handled_version")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HANDLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    lease_epoch: int
    handled_version: int
    def __init__(self, thread_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., handled_version: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateThreadRequest(_message.Message):
    __slots__ = ("thread_id", "initial_state_json", "policy")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    initial_state_json: bytes
    policy: str
    def __init__(self, thread_id: _Optional[str] = ..., initial_state_json: _Optional[bytes] = ..., policy: _Optional[str] = ...) -> None: ...

class CreateThreadResponse(_message.Message):
    __slots__ = ("genesis", "replayed")
    GENESIS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    genesis: Transition
    replayed: bool
    def __init__(self, genesis: _Optional[_Union[Transition, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class GetViewRequest(_message.Message):
    __slots__ = ("thread_id",)
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    def __init__(self, thread_id: _Optional[str] = ...) -> None: ...

class GetViewResponse(_message.Message):
    __slots__ = ("thread_id", "version", "state_json", "head_digest")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    state_json: bytes
    head_digest: str
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ..., state_json: _Optional[bytes] = ..., head_digest: _Optional[str] = ...) -> None: ...

class ProposeTransitionRequest(_message.Message):
    __slots__ = ("thread_id", "expected_version", "patch_json", "idempotency_key", "lease_epoch")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATCH_JSON_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    expected_version: int
    patch_json: bytes
    idempotency_key: str
    lease_epoch: int
    def __init__(self, thread_id: _Optional[str] = ..., expected_version: _Optional[int] = ..., patch_json: _Optional[bytes] = ..., idempotency_key: _Optional[str] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class ProposeTransitionResponse(_message.Message):
    __slots__ = ("transition", "pending", "replayed")
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    transition: Transition
    pending: PendingTransition
    replayed: bool
    def __init__(self, transition: _Optional[_Union[Transition, _Mapping]] = ..., pending: _Optional[_Union[PendingTransition, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class PendingTransition(_message.Message):
    __slots__ = ("digest", "thread_id", "base_version", "risk_rules", "proposal_json", "parked_at", "handle")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RISK_RULES_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_JSON_FIELD_NUMBER: _ClassVar[int]
    PARKED_AT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    thread_id: str
    base_version: int
    risk_rules: _containers.RepeatedScalarFieldContainer[str]
    proposal_json: bytes
    parked_at: _timestamp_pb2.Timestamp
    handle: str
    def __init__(self, digest: _Optional[str] = ..., thread_id: _Optional[str] = ..., base_version: _Optional[int] = ..., risk_rules: _Optional[_Iterable[str]] = ..., proposal_json: _Optional[bytes] = ..., parked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., handle: _Optional[str] = ...) -> None: ...

class GetTransitionRequest(_message.Message):
    __slots__ = ("digest", "thread_version", "head_of_thread")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREAD_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_OF_THREAD_FIELD_NUMBER: _ClassVar[int]
    digest: str
    thread_version: ThreadVersion
    head_of_thread: str
    def __init__(self, digest: _Optional[str] = ..., thread_version: _Optional[_Union[ThreadVersion, _Mapping]] = ..., head_of_thread: _Optional[str] = ...) -> None: ...

class ThreadVersion(_message.Message):
    __slots__ = ("thread_id", "version")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetTransitionResponse(_message.Message):
    __slots__ = ("transition", "receipt", "risk_rules")
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    RISK_RULES_FIELD_NUMBER: _ClassVar[int]
    transition: Transition
    receipt: _approval_pb2.SignedReceipt
    risk_rules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transition: _Optional[_Union[Transition, _Mapping]] = ..., receipt: _Optional[_Union[_approval_pb2.SignedReceipt, _Mapping]] = ..., risk_rules: _Optional[_Iterable[str]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("thread_id",)
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    def __init__(self, thread_id: _Optional[str] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: SignedCheckpoint
    def __init__(self, checkpoint: _Optional[_Union[SignedCheckpoint, _Mapping]] = ...) -> None: ...

class SignedCheckpoint(_message.Message):
    __slots__ = ("checkpoint_json", "signature", "key_id")
    CHECKPOINT_JSON_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_json: bytes
    signature: str
    key_id: str
    def __init__(self, checkpoint_json: _Optional[bytes] = ..., signature: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class WatchThreadRequest(_message.Message):
    __slots__ = ("thread_id", "from_version")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    from_version: int
    def __init__(self, thread_id: _Optional[str] = ..., from_version: _Optional[int] = ...) -> None: ...

class WatchThreadResponse(_message.Message):
    __slots__ = ("thread_id", "version", "digest", "state_json", "state_pruned")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_PRUNED_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    digest: str
    state_json: bytes
    state_pruned: bool
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., state_json: _Optional[bytes] = ..., state_pruned: _Optional[bool] = ...) -> None: ...

class ApplyDecisionRequest(_message.Message):
    __slots__ = ("receipt",)
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt: _approval_pb2.SignedReceipt
    def __init__(self, receipt: _Optional[_Union[_approval_pb2.SignedReceipt, _Mapping]] = ...) -> None: ...

class ApplyDecisionResponse(_message.Message):
    __slots__ = ("outcome", "transition", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    transition: Transition
    reason: str
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., transition: _Optional[_Union[Transition, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class WaitForOutcomeRequest(_message.Message):
    __slots__ = ("digest", "handle")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    handle: str
    def __init__(self, digest: _Optional[str] = ..., handle: _Optional[str] = ...) -> None: ...

class WaitForOutcomeResponse(_message.Message):
    __slots__ = ("outcome", "transition", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    transition: Transition
    reason: str
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., transition: _Optional[_Union[Transition, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class RevertThreadRequest(_message.Message):
    __slots__ = ("thread_id", "to_version", "idempotency_key")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    to_version: int
    idempotency_key: str
    def __init__(self, thread_id: _Optional[str] = ..., to_version: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class RevertThreadResponse(_message.Message):
    __slots__ = ("transition", "replayed")
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    transition: Transition
    replayed: bool
    def __init__(self, transition: _Optional[_Union[Transition, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class Transition(_message.Message):
    __slots__ = ("thread_id", "version", "digest", "parent_digest", "signature", "key_id", "record_json", "node_id", "committed_at")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    digest: str
    parent_digest: str
    signature: str
    key_id: str
    record_json: bytes
    node_id: str
    committed_at: _timestamp_pb2.Timestamp
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., parent_digest: _Optional[str] = ..., signature: _Optional[str] = ..., key_id: _Optional[str] = ..., record_json: _Optional[bytes] = ..., node_id: _Optional[str] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
