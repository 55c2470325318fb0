import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    ENFORCE: _ClassVar[Mode]
    SHADOW: _ClassVar[Mode]

class OnExcess(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_EXCESS_UNSPECIFIED: _ClassVar[OnExcess]
    CLAMP: _ClassVar[OnExcess]
    REJECT: _ClassVar[OnExcess]
MODE_UNSPECIFIED: Mode
ENFORCE: Mode
SHADOW: Mode
ON_EXCESS_UNSPECIFIED: OnExcess
CLAMP: OnExcess
REJECT: OnExcess

class Policy(_message.Message):
    __slots__ = ("tokens", "limits", "retry_after", "buckets", "mode", "trusted_headers")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_HEADERS_FIELD_NUMBER: _ClassVar[int]
    tokens: Tokens
    limits: Limits
    retry_after: RetryAfter
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    mode: Mode
    trusted_headers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Union[Tokens, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., retry_after: _Optional[_Union[RetryAfter, _Mapping]] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., mode: _Optional[_Union[Mode, str]] = ..., trusted_headers: _Optional[_Iterable[str]] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("chars_per_token", "tokenizer", "non_text_part_tokens", "message_overhead_tokens")
    CHARS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    NON_TEXT_PART_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_OVERHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    chars_per_token: float
    tokenizer: str
    non_text_part_tokens: int
    message_overhead_tokens: int
    def __init__(self, chars_per_token: _Optional[float] = ..., tokenizer: _Optional[str] = ..., non_text_part_tokens: _Optional[int] = ..., message_overhead_tokens: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_prompt_tokens", "default_max_tokens", "max_output_tokens", "on_excess", "max_queued_bytes")
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ON_EXCESS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_prompt_tokens: int
    default_max_tokens: int
    max_output_tokens: int
    on_excess: OnExcess
    max_queued_bytes: int
    def __init__(self, max_prompt_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., on_excess: _Optional[_Union[OnExcess, str]] = ..., max_queued_bytes: _Optional[int] = ...) -> None: ...

class RetryAfter(_message.Message):
    __slots__ = ("min", "max", "jitter")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    JITTER_FIELD_NUMBER: _ClassVar[int]
    min: _duration_pb2.Duration
    max: _duration_pb2.Duration
    jitter: float
    def __init__(self, min: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., jitter: _Optional[float] = ...) -> None: ...

class Match(_message.Message):
    __slots__ = ("headers", "max_prompt_tokens", "max_tokens")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.ScalarMap[str, str]
    max_prompt_tokens: int
    max_tokens: int
    def __init__(self, headers: _Optional[_Mapping[str, str]] = ..., max_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("name", "match", "max_concurrency", "queue_timeout", "max_queue", "trusted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    match: Match
    max_concurrency: int
    queue_timeout: _duration_pb2.Duration
    max_queue: int
    trusted: bool
    def __init__(self, name: _Optional[str] = ..., match: _Optional[_Union[Match, _Mapping]] = ..., max_concurrency: _Optional[int] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_queue: _Optional[int] = ..., trusted: _Optional[bool] = ...) -> None: ...

class RouteOverride(_message.Message):
    __slots__ = ("bucket", "max_concurrency", "max_queue", "queue_timeout", "max_prompt_tokens", "max_output_tokens", "default_max_tokens")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    max_concurrency: int
    max_queue: int
    queue_timeout: _duration_pb2.Duration
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_tokens: int
    def __init__(self, bucket: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., max_queue: _Optional[int] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_prompt_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ...) -> None: ...
