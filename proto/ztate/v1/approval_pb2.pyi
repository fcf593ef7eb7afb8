import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReviewStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REVIEW_STATUS_UNSPECIFIED: _ClassVar[ReviewStatus]
    REVIEW_STATUS_OPEN: _ClassVar[ReviewStatus]
    REVIEW_STATUS_APPROVED: _ClassVar[ReviewStatus]
    REVIEW_STATUS_REJECTED: _ClassVar[ReviewStatus]
    REVIEW_STATUS_EXPIRED: _ClassVar[ReviewStatus]

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_APPROVE: _ClassVar[Decision]
    DECISION_REJECT: _ClassVar[Decision]
REVIEW_STATUS_UNSPECIFIED: ReviewStatus
REVIEW_STATUS_OPEN: ReviewStatus
REVIEW_STATUS_APPROVED: ReviewStatus
REVIEW_STATUS_REJECTED: ReviewStatus
REVIEW_STATUS_EXPIRED: ReviewStatus
DECISION_UNSPECIFIED: Decision
DECISION_APPROVE: Decision
DECISION_REJECT: Decision

class SignedReceipt(_message.Message):
    __slots__ = ("receipt_json", "signature", "key_id")
    RECEIPT_JSON_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    receipt_json: bytes
    signature: str
    key_id: str
    def __init__(self, receipt_json: _Optional[bytes] = ..., signature: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class Review(_message.Message):
    __slots__ = ("digest", "thread_id", "base_version", "node_id", "risk_rules", "required_approvals", "redacted_diff_json", "status", "approvers", "opened_at", "expires_at", "receipt", "outcome")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RISK_RULES_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_APPROVALS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_DIFF_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    APPROVERS_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    digest: str
    thread_id: str
    base_version: int
    node_id: str
    risk_rules: _containers.RepeatedScalarFieldContainer[str]
    required_approvals: int
    redacted_diff_json: bytes
    status: ReviewStatus
    approvers: _containers.RepeatedScalarFieldContainer[str]
    opened_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    receipt: SignedReceipt
    outcome: str
    def __init__(self, digest: _Optional[str] = ..., thread_id: _Optional[str] = ..., base_version: _Optional[int] = ..., node_id: _Optional[str] = ..., risk_rules: _Optional[_Iterable[str]] = ..., required_approvals: _Optional[int] = ..., redacted_diff_json: _Optional[bytes] = ..., status: _Optional[_Union[ReviewStatus, str]] = ..., approvers: _Optional[_Iterable[str]] = ..., opened_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., receipt: _Optional[_Union[SignedReceipt, _Mapping]] = ..., outcome: _Optional[str] = ...) -> None: ...

class SubmitReviewRequest(_message.Message):
    __slots__ = ("digest", "thread_id", "base_version", "node_id", "risk_rules", "required_approvals", "proposal_json", "redacted_diff_json", "base_record_json", "base_state_json", "sensitive_keys")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RISK_RULES_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_APPROVALS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_JSON_FIELD_NUMBER: _ClassVar[int]
    REDACTED_DIFF_JSON_FIELD_NUMBER: _ClassVar[int]
    BASE_RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    BASE_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    SENSITIVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    thread_id: str
    base_version: int
    node_id: str
    risk_rules: _containers.RepeatedScalarFieldContainer[str]
    required_approvals: int
    proposal_json: bytes
    redacted_diff_json: bytes
    base_record_json: bytes
    base_state_json: bytes
    sensitive_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digest: _Optional[str] = ..., thread_id: _Optional[str] = ..., base_version: _Optional[int] = ..., node_id: _Optional[str] = ..., risk_rules: _Optional[_Iterable[str]] = ..., required_approvals: _Optional[int] = ..., proposal_json: _Optional[bytes] = ..., redacted_diff_json: _Optional[bytes] = ..., base_record_json: _Optional[bytes] = ..., base_state_json: _Optional[bytes] = ..., sensitive_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitReviewResponse(_message.Message):
    __slots__ = ("review",)
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    review: Review
    def __init__(self, review: _Optional[_Union[Review, _Mapping]] = ...) -> None: ...

class ListReviewsRequest(_message.Message):
    __slots__ = ("status", "thread_id", "page_size", "page_token")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    status: ReviewStatus
    thread_id: str
    page_size: int
    page_token: str
    def __init__(self, status: _Optional[_Union[ReviewStatus, str]] = ..., thread_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListReviewsResponse(_message.Message):
    __slots__ = ("reviews", "next_page_token")
    REVIEWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    reviews: _containers.RepeatedCompositeFieldContainer[Review]
    next_page_token: str
    def __init__(self, reviews: _Optional[_Iterable[_Union[Review, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetReviewRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class GetReviewResponse(_message.Message):
    __slots__ = ("review",)
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    review: Review
    def __init__(self, review: _Optional[_Union[Review, _Mapping]] = ...) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("digest", "decision")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    digest: str
    decision: Decision
    def __init__(self, digest: _Optional[str] = ..., decision: _Optional[_Union[Decision, str]] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("review",)
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    review: Review
    def __init__(self, review: _Optional[_Union[Review, _Mapping]] = ...) -> None: ...
