"""Stage 4, the gRPC shell: Envoy's ext_proc stream in, CONTINUE or an immediate answer out.

The servicer needs two things of a stream, ``await read()`` and ``await write(msg)``; it runs
on either gRPC transport (``extproc.h2``, the default, or grpc.aio; see ``extproc.app``).

Life of one request (Envoy 1.40, request headers SEND, request body BUFFERED, response SKIP;
see ../shared/ENVOY_NOTES.md):

1. ``request_headers``. Not a POST to /v1/chat/completions or /v1/completions: answer CONTINUE
   with a mode override that skips the body, then answer CONTINUE to anything else until the
   stream ends. Nothing is queued or counted. Otherwise refuse unreadable encodings (415) or a
   missing body (400) at once, else CONTINUE and wait for the body. Route metadata overrides
   (namespace ``llm_extproc``) arrive on this message as the ``xds.route_metadata`` attribute.
2. ``request_body`` (end_of_stream). Parse (``extproc.parse``), bound and classify
   (``extproc.classify``); a bad request gets its 4xx as an ImmediateResponse.
3. Admission (``extproc.gate``). Admitted at once, or queued: then we first send
   ``override_message_timeout`` so Envoy's short message timeout does not fire while we wait,
   and keep reading the stream so that a client who leaves is dropped from the queue at once.
   Queue full or evicted at the deadline: ImmediateResponse 429 with Retry-After.
4. Admitted: answer the body message with CONTINUE, the rewritten body (if max_tokens changed)
   and its content-length, headers for the backend, and dynamic metadata for the access log.
5. Hold: keep reading until Envoy ends the stream (it does so when the HTTP stream is done,
   after the last byte of the response) or cancels it (client gone). Then the slot goes back.

Shadow mode (``mode: shadow``): the same decisions are taken and counted, but every request is
let through unchanged and at once; what enforcement would have done is recorded as the
request's ``shadow_outcome``. A request that would have queued keeps a virtual place in its
bucket's queue, so would-be evictions and queue-full refusals are counted as under enforcement.

The slot is released in one ``finally`` and the request's single ``Outcome`` is recorded in the
same place, whatever ended the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2, json_format, text_format

from extproc.admission.gate import Gate, Refused, Slot, Waiter
from extproc.config.policy import (
    Mode,
    Policy,
    PolicyError,
    RouteOverride,
    route_override_from_mapping,
)
from extproc.ops.logs import log_finished
from extproc.ops.metrics import Metrics
from extproc.outcome import Outcome, Rejection, RequestError, queue_rejection
from extproc.record import RequestRecord
from extproc.request import respond as wire
from extproc.request.classify import Classification, TokenCounter, classify, token_counter
from extproc.request.parse import Endpoint, check_content_headers, endpoint_for_path, parse_body

__all__ = ["MESSAGE_TIMEOUT_MARGIN_S", "METADATA_NAMESPACE", "ExtProcService"]

log = logging.getLogger("extproc.server")

# The message-timeout override sent while queued is the queue timeout plus this margin, so our
# own eviction (a 429 with Retry-After) always fires before Envoy's 504. Envoy's
# max_message_timeout must be at least the longest queue_timeout plus this margin.
MESSAGE_TIMEOUT_MARGIN_S = 1.0

# Route metadata namespace read from Envoy, and the dynamic metadata namespace we write.
METADATA_NAMESPACE = "llm_extproc"
_ROUTE_ATTRIBUTE = "xds.route_metadata"
_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
_ROUTE_CACHE_SIZE = 256

_EOF = grpc.aio.EOF


class _Context(Protocol):
    """What the servicer needs of a stream; grpc.aio's context and ``extproc.h2.Call`` both
    have it. ``read`` returns ``grpc.aio.EOF`` once Envoy half-closed the stream."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...


_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_PASS_THROUGH = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.NONE
    ),
)


def _continue_for(msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """A plain CONTINUE answering whatever message Envoy sent."""
    kind = msg.WhichOneof("request")
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    return pb.ProcessingResponse()


def _metadata(rec: RequestRecord) -> bytes:
    """Dynamic metadata for Envoy's access log: %DYNAMIC_METADATA(llm_extproc:bucket)% etc."""
    fields: dict[str, str | int] = {
        "bucket": rec.bucket,
        "outcome": str(rec.outcome),
        "queue_ms": round(rec.queue_s * 1000),
    }
    if rec.prompt_tokens is not None:
        fields["prompt_tokens"] = rec.prompt_tokens
    if rec.max_tokens is not None:
        fields["max_tokens"] = rec.max_tokens
    if rec.code is not None:
        fields["code"] = rec.code
    if rec.shadow_outcome is not None:
        fields["shadow_outcome"] = str(rec.shadow_outcome)
    return wire.metadata_struct(METADATA_NAMESPACE, fields)


def _immediate(rejection: Rejection, rec: RequestRecord) -> bytes:
    return wire.immediate(
        rejection.status,
        rejection.headers(),
        rejection.body,
        f"llm_extproc_{rec.code}",
        _metadata(rec),
    )


def _admit(cls: Classification, rec: RequestRecord) -> bytes:
    headers = [
        ("x-llm-bucket", cls.bucket.name),
        ("x-llm-queue-ms", str(round(rec.queue_s * 1000))),
        ("x-llm-prompt-tokens", str(cls.prompt_tokens)),
        # Echoed to the client by the route's response_headers_to_add (%REQ(x-llm-max-tokens)%),
        # which spares us a round trip on the response path.
        ("x-llm-max-tokens", str(cls.max_tokens)),
    ]
    if cls.new_body is not None:
        headers.append(("content-length", str(len(cls.new_body))))
    # Header values go out as raw_value bytes, with OVERWRITE_IF_EXISTS_OR_ADD (ENVOY_NOTES).
    return wire.body_continue(headers, cls.new_body, _metadata(rec))


def _timeout_override(seconds: float) -> pb.ProcessingResponse:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return pb.ProcessingResponse(override_message_timeout=d)


def _headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


class _Stream:
    """Per-stream state the ``finally`` needs: what is held, and the record."""

    __slots__ = ("rec", "shadow_task", "slot", "waiter")

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.slot: Slot | None = None
        self.waiter: Waiter | None = None
        self.shadow_task: asyncio.Task[None] | None = None


class _Invalid:
    """A route's metadata that failed validation (cached, so it is logged once)."""


_INVALID = _Invalid()


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, policy: Policy, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._routes: dict[str, RouteOverride | _Invalid | None] = {}
        self.apply_policy(policy)

    def apply_policy(self, policy: Policy) -> None:
        """Switch to a new policy: the next request uses it. Raises if it cannot be used
        (e.g. its tokenizer file does not load); then nothing changes."""
        count: TokenCounter = token_counter(policy.tokens)
        self._gate.reconfigure(policy)
        self._metrics.declare(b.name for b in policy.buckets)
        self._policy, self._count = policy, count
        self._routes.clear()  # route overrides are validated against the policy

    @property
    def policy(self) -> Policy:
        return self._policy

    def handler(self) -> grpc.GenericRpcHandler:
        """The Process method, registered so that pre-encoded answers (bytes from
        ``extproc.wire``) and messages can both be written to the stream."""
        return grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.Process,
                    request_deserializer=pb.ProcessingRequest.FromString,
                    response_serializer=wire.serialize,
                )
            },
        )

    async def Process(self, request_iterator: object, context: _Context) -> None:
        msg = await context.read()
        if msg is _EOF:
            return
        if msg.WhichOneof("request") != "request_headers":
            await self._pass_through(context, msg)
            return
        headers = _headers_of(msg.request_headers)
        endpoint = endpoint_for_path(headers.get(":method", ""), headers.get(":path", ""))
        if endpoint is None:
            await context.write(_PASS_THROUGH)
            await self._pass_through(context, None)
            return

        st = _Stream(RequestRecord(headers.get("x-request-id", "")))
        try:
            handling = self._handle(context, msg, headers, endpoint, st)
            del msg, headers  # _handle drops them before it waits: a waiter keeps little
            await handling
        except asyncio.CancelledError:
            raise  # the stream was cancelled: Envoy saw the client go
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            self._finish(st)

    # --- one admitted-path request ------------------------------------------------------------

    async def _handle(
        self,
        context: _Context,
        msg: pb.ProcessingRequest,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        st: _Stream,
    ) -> None:
        policy = self._policy
        shadow = policy.mode is Mode.SHADOW
        rec = st.rec
        route = self._route_override(msg, policy)
        try:
            check_content_headers(headers.get("content-type"), headers.get("content-encoding"))
            if msg.request_headers.end_of_stream:
                raise RequestError(
                    400, "empty_body", "The request body is empty; send a JSON object."
                )
        except RequestError as e:
            if not shadow or msg.request_headers.end_of_stream:
                await self._refuse(context, rec, e.outcome, e.rejection())
                return
            self._note_shadow(rec, e.outcome, e.code)
        await context.write(_HEADERS_CONTINUE)

        body = await self._read_body(context)
        if body is None:
            return  # stream ended before the body: CANCELLED_BEFORE_BODY
        rec.arrived_at = self._loop.time()
        if rec.shadow_outcome is not None:  # unreadable body in shadow mode: let it through
            await self._admit_unchanged(context, rec)
            await self._hold(context, None)
            return
        try:
            parsed = parse_body(endpoint, body)
            rec.stream = parsed.stream
            cls = classify(policy, self._count, headers, parsed, route)
        except RequestError as e:
            if not shadow:
                await self._refuse(context, rec, e.outcome, e.rejection())
                return
            self._note_shadow(rec, e.outcome, e.code)
            await self._admit_unchanged(context, rec)
            await self._hold(context, None)
            return
        # A queued request may wait long, thousands at once: keep only the classification.
        del msg, headers, body, parsed
        rec.bucket = cls.bucket.name
        rec.prompt_tokens = cls.prompt_tokens
        rec.max_tokens = cls.max_tokens
        rec.max_tokens_action = str(cls.max_tokens_action)

        timeout = cls.queue_timeout_s
        try:
            entry = self._gate.enter(cls.bucket.name, timeout)
        except Refused as r:
            if not shadow:
                await self._refuse_queue(context, rec, r, timeout)
                return
            self._note_shadow(rec, r.outcome, r.code)
            entry = None
        if shadow:
            if isinstance(entry, Waiter):
                st.shadow_task = asyncio.ensure_future(self._shadow_wait(st, entry))
            else:
                st.slot = entry
            await self._admit_unchanged(context, rec)
            await self._hold(context, None)
            return

        pending_read: asyncio.Future[Any] | None = None
        if isinstance(entry, Waiter):
            st.waiter = entry
            await context.write(_timeout_override(timeout + MESSAGE_TIMEOUT_MARGIN_S))
            pending_read, slot = await self._wait(context, rec, entry)
            st.waiter = None
            if slot is None:
                return  # left the queue: evicted (answered) or the stream ended
        else:
            assert isinstance(entry, Slot)
            slot = entry
        st.slot = slot
        rec.outcome = Outcome.ADMITTED
        rec.decided_at = self._loop.time()
        await context.write(_admit(cls, rec))
        await self._hold(context, pending_read)

    async def _hold(self, context: _Context, pending_read: asyncio.Future[Any] | None) -> None:
        """Keep the stream (and any slot) until Envoy ends it."""
        while True:
            if pending_read is not None:
                nxt, pending_read = await pending_read, None
            else:
                nxt = await context.read()
            if nxt is _EOF:
                return
            await context.write(_continue_for(nxt))

    async def _wait(
        self, context: _Context, rec: RequestRecord, waiter: Waiter
    ) -> tuple[asyncio.Future[Any] | None, Slot | None]:
        """Wait for a slot while watching the stream. Returns the read still pending (to be
        awaited by the hold loop) and the slot, or (None, None) when the request left the
        queue."""
        task = asyncio.current_task()
        assert task is not None
        stream_ended = False

        def on_read(_: asyncio.Future[Any]) -> None:
            # Envoy half-closed or sent something while we were queued: the stream is over
            # for us. Take the waiter out of the queue now.
            nonlocal stream_ended
            stream_ended = True
            task.cancel()

        read: asyncio.Future[Any] = asyncio.ensure_future(context.read())
        read.add_done_callback(on_read)
        try:
            slot = await waiter.admitted()
        except Refused as r:
            read.remove_done_callback(on_read)
            read.cancel()
            limit = waiter.ticket.deadline - waiter.ticket.enqueued_at
            await self._refuse_queue(context, rec, r, limit)
            return None, None
        except asyncio.CancelledError:
            read.remove_done_callback(on_read)
            if not stream_ended:
                read.cancel()
                raise
            task.uncancel()
            return None, None
        read.remove_done_callback(on_read)
        return read, slot

    async def _shadow_wait(self, st: _Stream, waiter: Waiter) -> None:
        """Shadow mode: keep the request's virtual place in the queue while it runs."""
        try:
            st.slot = await waiter.admitted()  # released when the stream ends
        except Refused as r:
            self._note_shadow(st.rec, r.outcome, r.code)

    # --- answers -----------------------------------------------------------------------------

    async def _read_body(self, context: _Context) -> bytes | None:
        chunks: list[bytes] = []
        while True:
            msg = await context.read()
            if msg is _EOF:
                return None
            kind = msg.WhichOneof("request")
            if kind != "request_body":
                # Not expected with BUFFERED bodies; answer and keep waiting for the body.
                await context.write(_continue_for(msg))
                continue
            chunks.append(msg.request_body.body)
            if msg.request_body.end_of_stream:
                return b"".join(chunks)
            # A chunk not marked last (STREAMED mode): acknowledge it and wait for more.
            await context.write(_continue_for(msg))

    async def _refuse(
        self,
        context: _Context,
        rec: RequestRecord,
        outcome: Outcome,
        rejection: Rejection,
    ) -> None:
        rec.outcome = outcome
        rec.code = rejection.code
        rec.decided_at = self._loop.time()
        await context.write(_immediate(rejection, rec))

    async def _refuse_queue(
        self, context: _Context, rec: RequestRecord, r: Refused, limit_s: float
    ) -> None:
        rejection = queue_rejection(
            r.outcome,
            bucket=r.bucket,
            retry_after_s=r.retry_after_s,
            queued=r.queued,
            waited_s=r.waited_s,
            limit_s=limit_s,
        )
        await self._refuse(context, rec, r.outcome, rejection)

    async def _admit_unchanged(self, context: _Context, rec: RequestRecord) -> None:
        rec.outcome = Outcome.ADMITTED
        rec.decided_at = self._loop.time()
        await context.write(wire.body_continue((), None, _metadata(rec)))

    def _note_shadow(self, rec: RequestRecord, outcome: Outcome, code: str) -> None:
        if rec.shadow_outcome is None:
            rec.shadow_outcome = outcome
            rec.code = code

    async def _pass_through(self, context: _Context, first: pb.ProcessingRequest | None) -> None:
        if first is not None:
            await context.write(_continue_for(first))
        while (msg := await context.read()) is not _EOF:
            await context.write(_continue_for(msg))

    # --- route metadata ----------------------------------------------------------------------

    def _route_override(self, msg: pb.ProcessingRequest, policy: Policy) -> RouteOverride | None:
        if _ATTRIBUTES_KEY not in msg.attributes:
            return None
        value = msg.attributes[_ATTRIBUTES_KEY].fields.get(_ROUTE_ATTRIBUTE)
        raw = value.string_value if value is not None else ""
        if not raw:
            return None
        if raw in self._routes:
            cached = self._routes[raw]
        else:
            if len(self._routes) >= _ROUTE_CACHE_SIZE:
                self._routes.clear()
            cached = self._routes[raw] = self._compile_route(raw, policy)
        if isinstance(cached, _Invalid):
            self._metrics.route_policy_errors.inc()
            return None
        return cached

    def _compile_route(self, raw: str, policy: Policy) -> RouteOverride | _Invalid | None:
        """Parse and validate one route's metadata; apply its bucket limits to the gate."""
        try:
            md = text_format.Parse(raw, base_pb2.Metadata())
        except text_format.ParseError as e:
            log.warning("route metadata is not text-format Metadata: %s", e)
            return _INVALID
        if METADATA_NAMESPACE not in md.filter_metadata:
            return None
        data = json_format.MessageToDict(md.filter_metadata[METADATA_NAMESPACE])
        try:
            override = route_override_from_mapping(data, policy)
        except PolicyError as e:
            log.warning(
                "route metadata %s.%s refused; the policy file applies to this route",
                METADATA_NAMESPACE,
                e,
                extra={"fields": {"route_metadata": data}},
            )
            return _INVALID
        if override.bucket is not None and (
            override.max_concurrency is not None or override.max_queue is not None
        ):
            b = policy.bucket(override.bucket)
            self._gate.set_limits(
                b.name,
                override.max_concurrency or b.max_concurrency,
                b.max_queue if override.max_queue is None else override.max_queue,
            )
        return override

    # --- the one place a request is finished ---------------------------------------------------

    def _finish(self, st: _Stream) -> None:
        if st.shadow_task is not None and not st.shadow_task.done():
            st.shadow_task.cancel()  # leaves the virtual queue (Waiter.admitted cleans up)
        if st.slot is not None:
            st.slot.release()
        if st.waiter is not None:
            st.waiter.cancel()
        rec = st.rec
        rec.ended_at = self._loop.time()
        if rec.outcome is None:
            rec.outcome = (
                Outcome.CANCELLED_WHILE_QUEUED
                if rec.arrived_at is not None
                else Outcome.CANCELLED_BEFORE_BODY
            )
        self._metrics.finish(rec)
        log_finished(rec)
