import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListThreadsRequest(_message.Message):
    __slots__ = ("policy", "page_size", "page_token")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    policy: str
    page_size: int
    page_token: str
    def __init__(self, policy: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListThreadsResponse(_message.Message):
    __slots__ = ("threads", "next_page_token")
    THREADS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    threads: _containers.RepeatedCompositeFieldContainer[ThreadHead]
    next_page_token: str
    def __init__(self, threads: _Optional[_Iterable[_Union[ThreadHead, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ThreadHead(_message.Message):
    __slots__ = ("thread_id", "policy", "version", "head_digest", "created_at", "updated_at")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    policy: str
    version: int
    head_digest: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, thread_id: _Optional[str] = ..., policy: _Optional[str] = ..., version: _Optional[int] = ..., head_digest: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DescribeThreadRequest(_message.Message):
    __slots__ = ("thread_id",)
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    def __init__(self, thread_id: _Optional[str] = ...) -> None: ...

class DescribeThreadResponse(_message.Message):
    __slots__ = ("thread", "work")
    THREAD_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    thread: ThreadHead
    work: _containers.RepeatedCompositeFieldContainer[NodeWork]
    def __init__(self, thread: _Optional[_Union[ThreadHead, _Mapping]] = ..., work: _Optional[_Iterable[_Union[NodeWork, _Mapping]]] = ...) -> None: ...

class NodeWork(_message.Message):
    __slots__ = ("node", "wake_version", "handled_version", "due", "holder", "lease_epoch", "lease_expires_at")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WAKE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    DUE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    node: str
    wake_version: int
    handled_version: int
    due: bool
    holder: str
    lease_epoch: int
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, node: _Optional[str] = ..., wake_version: _Optional[int] = ..., handled_version: _Optional[int] = ..., due: _Optional[bool] = ..., holder: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListRejectionsRequest(_message.Message):
    __slots__ = ("thread_id", "node_id", "reason", "since", "until", "page_size", "page_token")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    node_id: str
    reason: str
    since: _timestamp_pb2.Timestamp
    until: _timestamp_pb2.Timestamp
    page_size: int
    page_token: str
    def __init__(self, thread_id: _Optional[str] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRejectionsResponse(_message.Message):
    __slots__ = ("rejections", "next_page_token")
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    next_page_token: str
    def __init__(self, rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("id", "rejected_at", "method", "node_id", "thread_id", "base_version", "reason", "keys", "patch_digest", "patch_bytes", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    REJECTED_AT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PATCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    rejected_at: _timestamp_pb2.Timestamp
    method: str
    node_id: str
    thread_id: str
    base_version: int
    reason: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    patch_digest: str
    patch_bytes: int
    message: str
    def __init__(self, id: _Optional[int] = ..., rejected_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., method: _Optional[str] = ..., node_id: _Optional[str] = ..., thread_id: _Optional[str] = ..., base_version: _Optional[int] = ..., reason: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., patch_digest: _Optional[str] = ..., patch_bytes: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListTransitionsRequest(_message.Message):
    __slots__ = ("thread_id", "node_id", "changed_key", "status", "since", "until", "page_size", "page_token")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGED_KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    node_id: str
    changed_key: str
    status: str
    since: _timestamp_pb2.Timestamp
    until: _timestamp_pb2.Timestamp
    page_size: int
    page_token: str
    def __init__(self, thread_id: _Optional[str] = ..., node_id: _Optional[str] = ..., changed_key: _Optional[str] = ..., status: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTransitionsResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("thread_id", "version", "digest", "parent_digest", "node_id", "kind", "status", "at", "changed_keys", "has_receipt")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    CHANGED_KEYS_FIELD_NUMBER: _ClassVar[int]
    HAS_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    version: int
    digest: str
    parent_digest: str
    node_id: str
    kind: str
    status: str
    at: _timestamp_pb2.Timestamp
    changed_keys: _containers.RepeatedScalarFieldContainer[str]
    has_receipt: bool
    def __init__(self, thread_id: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., parent_digest: _Optional[str] = ..., node_id: _Optional[str] = ..., kind: _Optional[str] = ..., status: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., changed_keys: _Optional[_Iterable[str]] = ..., has_receipt: _Optional[bool] = ...) -> None: ...

class GetTransitionDetailRequest(_message.Message):
    __slots__ = ("digest", "thread_id", "version")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    digest: str
    thread_id: str
    version: int
    def __init__(self, digest: _Optional[str] = ..., thread_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetTransitionDetailResponse(_message.Message):
    __slots__ = ("entry", "record_json", "patch_json", "state_json", "state_kept", "key_id", "signature", "receipt_json", "receipt_signature", "receipt_key_id")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    PATCH_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_KEPT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_JSON_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    entry: LedgerEntry
    record_json: str
    patch_json: str
    state_json: str
    state_kept: bool
    key_id: str
    signature: str
    receipt_json: str
    receipt_signature: str
    receipt_key_id: str
    def __init__(self, entry: _Optional[_Union[LedgerEntry, _Mapping]] = ..., record_json: _Optional[str] = ..., patch_json: _Optional[str] = ..., state_json: _Optional[str] = ..., state_kept: _Optional[bool] = ..., key_id: _Optional[str] = ..., signature: _Optional[str] = ..., receipt_json: _Optional[str] = ..., receipt_signature: _Optional[str] = ..., receipt_key_id: _Optional[str] = ...) -> None: ...

class KeyHistoryRequest(_message.Message):
    __slots__ = ("thread_id", "key", "page_size", "page_token")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    thread_id: str
    key: str
    page_size: int
    page_token: str
    def __init__(self, thread_id: _Optional[str] = ..., key: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class KeyHistoryResponse(_message.Message):
    __slots__ = ("changes", "next_page_token")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[KeyChange]
    next_page_token: str
    def __init__(self, changes: _Optional[_Iterable[_Union[KeyChange, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class KeyChange(_message.Message):
    __slots__ = ("version", "digest", "node_id", "committed_at", "removed", "value_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    node_id: str
    committed_at: _timestamp_pb2.Timestamp
    removed: bool
    value_json: str
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., node_id: _Optional[str] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., removed: _Optional[bool] = ..., value_json: _Optional[str] = ...) -> None: ...
