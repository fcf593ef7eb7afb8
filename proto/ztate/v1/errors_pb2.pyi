from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_IDENTITY_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_ROLE_FORBIDDEN: _ClassVar[ErrorReason]
    ERROR_REASON_NODE_NOT_REGISTERED: _ClassVar[ErrorReason]
    ERROR_REASON_KEY_NOT_WRITABLE: _ClassVar[ErrorReason]
    ERROR_REASON_PATCH_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_PATCH_MALFORMED: _ClassVar[ErrorReason]
    ERROR_REASON_VALUE_OUT_OF_RANGE: _ClassVar[ErrorReason]
    ERROR_REASON_STALE_VERSION: _ClassVar[ErrorReason]
    ERROR_REASON_THREAD_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_THREAD_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSITION_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_IDEMPOTENCY_KEY_REUSED: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_KEY_UNKNOWN: _ClassVar[ErrorReason]
    ERROR_REASON_STORAGE_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_SCHEMA_VIOLATION: _ClassVar[ErrorReason]
    ERROR_REASON_LAYER_VIOLATION: _ClassVar[ErrorReason]
    ERROR_REASON_INVARIANT_VIOLATED: _ClassVar[ErrorReason]
    ERROR_REASON_CREDENTIAL_DETECTED: _ClassVar[ErrorReason]
    ERROR_REASON_POLICY_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_POLICY_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_RECEIPT_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_RECEIPT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_RECEIPT_EXPIRED: _ClassVar[ErrorReason]
    ERROR_REASON_RECEIPT_REPLAYED: _ClassVar[ErrorReason]
    ERROR_REASON_APPROVAL_STALE: _ClassVar[ErrorReason]
    ERROR_REASON_REVIEW_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_REVIEW_CLOSED: _ClassVar[ErrorReason]
    ERROR_REASON_SELF_APPROVAL: _ClassVar[ErrorReason]
    ERROR_REASON_ALREADY_DECIDED: _ClassVar[ErrorReason]
    ERROR_REASON_STATE_PRUNED: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_STREAMS: _ClassVar[ErrorReason]
    ERROR_REASON_UNSUPPORTED_CHARACTER: _ClassVar[ErrorReason]
    ERROR_REASON_STATE_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_IDENTITY_REVOKED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_LOST: _ClassVar[ErrorReason]
    ERROR_REASON_NO_WAKE_DECLARED: _ClassVar[ErrorReason]
    ERROR_REASON_QUERY_TOO_COSTLY: _ClassVar[ErrorReason]
    ERROR_REASON_CERTIFICATE_EXPIRED: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_IDENTITY_INVALID: ErrorReason
ERROR_REASON_ROLE_FORBIDDEN: ErrorReason
ERROR_REASON_NODE_NOT_REGISTERED: ErrorReason
ERROR_REASON_KEY_NOT_WRITABLE: ErrorReason
ERROR_REASON_PATCH_TOO_LARGE: ErrorReason
ERROR_REASON_PATCH_MALFORMED: ErrorReason
ERROR_REASON_VALUE_OUT_OF_RANGE: ErrorReason
ERROR_REASON_STALE_VERSION: ErrorReason
ERROR_REASON_THREAD_NOT_FOUND: ErrorReason
ERROR_REASON_THREAD_EXISTS: ErrorReason
ERROR_REASON_TRANSITION_NOT_FOUND: ErrorReason
ERROR_REASON_IDEMPOTENCY_KEY_REUSED: ErrorReason
ERROR_REASON_REQUEST_INVALID: ErrorReason
ERROR_REASON_KEY_UNKNOWN: ErrorReason
ERROR_REASON_STORAGE_UNAVAILABLE: ErrorReason
ERROR_REASON_SCHEMA_VIOLATION: ErrorReason
ERROR_REASON_LAYER_VIOLATION: ErrorReason
ERROR_REASON_INVARIANT_VIOLATED: ErrorReason
ERROR_REASON_CREDENTIAL_DETECTED: ErrorReason
ERROR_REASON_POLICY_NOT_FOUND: ErrorReason
ERROR_REASON_POLICY_MISMATCH: ErrorReason
ERROR_REASON_RECEIPT_INVALID: ErrorReason
ERROR_REASON_RECEIPT_MISMATCH: ErrorReason
ERROR_REASON_RECEIPT_EXPIRED: ErrorReason
ERROR_REASON_RECEIPT_REPLAYED: ErrorReason
ERROR_REASON_APPROVAL_STALE: ErrorReason
ERROR_REASON_REVIEW_NOT_FOUND: ErrorReason
ERROR_REASON_REVIEW_CLOSED: ErrorReason
ERROR_REASON_SELF_APPROVAL: ErrorReason
ERROR_REASON_ALREADY_DECIDED: ErrorReason
ERROR_REASON_STATE_PRUNED: ErrorReason
ERROR_REASON_TOO_MANY_STREAMS: ErrorReason
ERROR_REASON_UNSUPPORTED_CHARACTER: ErrorReason
ERROR_REASON_STATE_TOO_LARGE: ErrorReason
ERROR_REASON_IDENTITY_REVOKED: ErrorReason
ERROR_REASON_LEASE_LOST: ErrorReason
ERROR_REASON_NO_WAKE_DECLARED: ErrorReason
ERROR_REASON_QUERY_TOO_COSTLY: ErrorReason
ERROR_REASON_CERTIFICATE_EXPIRED: ErrorReason

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "keys", "current_version", "limit", "rules", "keys_total")
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    KEYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    keys: _containers.RepeatedScalarFieldContainer[str]
    current_version: int
    limit: int
    rules: _containers.RepeatedScalarFieldContainer[str]
    keys_total: int
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ..., keys: _Optional[_Iterable[str]] = ..., current_version: _Optional[int] = ..., limit: _Optional[int] = ..., rules: _Optional[_Iterable[str]] = ..., keys_total: _Optional[int] = ...) -> None: ...
