import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
