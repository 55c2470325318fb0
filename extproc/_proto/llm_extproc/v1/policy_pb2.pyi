import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Order(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORDER_UNSPECIFIED: _ClassVar[Order]
    FIFO: _ClassVar[Order]
    COST: _ClassVar[Order]
    FAIR: _ClassVar[Order]

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
ORDER_UNSPECIFIED: Order
FIFO: Order
COST: Order
FAIR: Order
MODE_UNSPECIFIED: Mode
ENFORCE: Mode
SHADOW: Mode
ON_EXCESS_UNSPECIFIED: OnExcess
CLAMP: OnExcess
REJECT: OnExcess

class Policy(_message.Message):
    __slots__ = ("tokens", "limits", "retry_after", "buckets", "mode", "trusted_headers", "pool", "backend", "client_deadline", "endpoints")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_HEADERS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    tokens: Tokens
    limits: Limits
    retry_after: RetryAfter
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    mode: Mode
    trusted_headers: _containers.RepeatedScalarFieldContainer[str]
    pool: Pool
    backend: Backend
    client_deadline: ClientDeadline
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Union[Tokens, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., retry_after: _Optional[_Union[RetryAfter, _Mapping]] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., mode: _Optional[_Union[Mode, str]] = ..., trusted_headers: _Optional[_Iterable[str]] = ..., pool: _Optional[_Union[Pool, _Mapping]] = ..., backend: _Optional[_Union[Backend, _Mapping]] = ..., client_deadline: _Optional[_Union[ClientDeadline, _Mapping]] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("max_concurrency", "max_tokens_in_flight", "fail_fast", "adaptive", "overload", "shared")
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FAIL_FAST_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    max_concurrency: int
    max_tokens_in_flight: int
    fail_fast: bool
    adaptive: Adaptive
    overload: Overload
    shared: Shared
    def __init__(self, max_concurrency: _Optional[int] = ..., max_tokens_in_flight: _Optional[int] = ..., fail_fast: _Optional[bool] = ..., adaptive: _Optional[_Union[Adaptive, _Mapping]] = ..., overload: _Optional[_Union[Overload, _Mapping]] = ..., shared: _Optional[_Union[Shared, _Mapping]] = ...) -> None: ...

class Shared(_message.Message):
    __slots__ = ("redis", "key_prefix", "lease", "timeout", "replicas")
    REDIS_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    redis: str
    key_prefix: str
    lease: _duration_pb2.Duration
    timeout: _duration_pb2.Duration
    replicas: int
    def __init__(self, redis: _Optional[str] = ..., key_prefix: _Optional[str] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., replicas: _Optional[int] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft", "ttft_quantile", "inter_token", "inter_token_quantile", "tpot", "tpot_quantile", "abandoned", "queue_time", "queue_time_quantile")
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TTFT_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    TPOT_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    ttft: _duration_pb2.Duration
    ttft_quantile: float
    inter_token: _duration_pb2.Duration
    inter_token_quantile: float
    tpot: _duration_pb2.Duration
    tpot_quantile: float
    abandoned: float
    queue_time: _duration_pb2.Duration
    queue_time_quantile: float
    def __init__(self, ttft: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ttft_quantile: _Optional[float] = ..., inter_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., inter_token_quantile: _Optional[float] = ..., tpot: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tpot_quantile: _Optional[float] = ..., abandoned: _Optional[float] = ..., queue_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., queue_time_quantile: _Optional[float] = ...) -> None: ...

class Adaptive(_message.Message):
    __slots__ = ("min", "max", "initial", "slo", "interval", "window", "max_kv_usage", "stale_after", "fallback_after", "queue_while_no_backend")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    STALE_AFTER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_AFTER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WHILE_NO_BACKEND_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    initial: int
    slo: Slo
    interval: _duration_pb2.Duration
    window: _duration_pb2.Duration
    max_kv_usage: float
    stale_after: _duration_pb2.Duration
    fallback_after: _duration_pb2.Duration
    queue_while_no_backend: bool
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ..., initial: _Optional[int] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., window: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_kv_usage: _Optional[float] = ..., stale_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., fallback_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., queue_while_no_backend: _Optional[bool] = ...) -> None: ...

class Overload(_message.Message):
    __slots__ = ("enabled", "tighten_eviction_rate", "step_hold", "window")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TIGHTEN_EVICTION_RATE_FIELD_NUMBER: _ClassVar[int]
    STEP_HOLD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    tighten_eviction_rate: float
    step_hold: _duration_pb2.Duration
    window: _duration_pb2.Duration
    def __init__(self, enabled: _Optional[bool] = ..., tighten_eviction_rate: _Optional[float] = ..., step_hold: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., window: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Backend(_message.Message):
    __slots__ = ("metrics", "scrape_timeout")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedScalarFieldContainer[str]
    scrape_timeout: _duration_pb2.Duration
    def __init__(self, metrics: _Optional[_Iterable[str]] = ..., scrape_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ClientDeadline(_message.Message):
    __slots__ = ("headers", "margin", "seconds_headers")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedScalarFieldContainer[str]
    margin: _duration_pb2.Duration
    seconds_headers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, headers: _Optional[_Iterable[str]] = ..., margin: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., seconds_headers: _Optional[_Iterable[str]] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("header", "authorization", "max_tracked", "idle_ttl", "max_queue", "max_share", "class_header", "weights", "export_top")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_TRACKED_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARE_FIELD_NUMBER: _ClassVar[int]
    CLASS_HEADER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_TOP_FIELD_NUMBER: _ClassVar[int]
    header: str
    authorization: bool
    max_tracked: int
    idle_ttl: _duration_pb2.Duration
    max_queue: int
    max_share: float
    class_header: str
    weights: _containers.ScalarMap[str, float]
    export_top: int
    def __init__(self, header: _Optional[str] = ..., authorization: _Optional[bool] = ..., max_tracked: _Optional[int] = ..., idle_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_queue: _Optional[int] = ..., max_share: _Optional[float] = ..., class_header: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ..., export_top: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("max_prompt_tokens", "default_max_tokens", "max_output_tokens", "on_excess", "max_queued_bytes", "max_sequences")
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ON_EXCESS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    max_prompt_tokens: int
    default_max_tokens: int
    max_output_tokens: int
    on_excess: OnExcess
    max_queued_bytes: int
    max_sequences: int
    def __init__(self, max_prompt_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., on_excess: _Optional[_Union[OnExcess, str]] = ..., max_queued_bytes: _Optional[int] = ..., max_sequences: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("headers", "max_prompt_tokens", "max_tokens", "retried", "models")
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
    RETRIED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.ScalarMap[str, str]
    max_prompt_tokens: int
    max_tokens: int
    retried: bool
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, headers: _Optional[_Mapping[str, str]] = ..., max_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., retried: _Optional[bool] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("name", "match", "max_concurrency", "queue_timeout", "max_queue", "trusted", "priority", "min_share", "max_share", "order", "vllm_priority", "tenant", "relegate_to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MIN_SHARE_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    VLLM_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RELEGATE_TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    match: Match
    max_concurrency: int
    queue_timeout: _duration_pb2.Duration
    max_queue: int
    trusted: bool
    priority: int
    min_share: float
    max_share: float
    order: Order
    vllm_priority: int
    tenant: Tenant
    relegate_to: str
    def __init__(self, name: _Optional[str] = ..., match: _Optional[_Union[Match, _Mapping]] = ..., max_concurrency: _Optional[int] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_queue: _Optional[int] = ..., trusted: _Optional[bool] = ..., priority: _Optional[int] = ..., min_share: _Optional[float] = ..., max_share: _Optional[float] = ..., order: _Optional[_Union[Order, str]] = ..., vllm_priority: _Optional[int] = ..., tenant: _Optional[_Union[Tenant, _Mapping]] = ..., relegate_to: _Optional[str] = ...) -> None: ...

class RouteOverride(_message.Message):
    __slots__ = ("bucket", "max_concurrency", "max_queue", "queue_timeout", "max_prompt_tokens", "max_output_tokens", "default_max_tokens", "timeout", "model_buckets")
    class ModelBucketsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    max_concurrency: int
    max_queue: int
    queue_timeout: _duration_pb2.Duration
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_tokens: int
    timeout: _duration_pb2.Duration
    model_buckets: _containers.ScalarMap[str, str]
    def __init__(self, bucket: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., max_queue: _Optional[int] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_prompt_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., model_buckets: _Optional[_Mapping[str, str]] = ...) -> None: ...
