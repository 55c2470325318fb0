"""Stage 4, the gRPC shell: Envoy's ext_proc stream in, CONTINUE or an immediate answer out.

Life of one request (Envoy 1.40, request headers SEND, request body BUFFERED, response SKIP;
see ../shared/ENVOY_NOTES.md):

1. ``request_headers``. Not a POST to /v1/chat/completions or /v1/completions: answer CONTINUE
   with a mode override that skips the body, then answer CONTINUE to anything else until the
   stream ends. Nothing is queued or counted. Otherwise refuse unreadable encodings (415) or a
   missing body (400) at once, else CONTINUE and wait for the body.
2. ``request_body`` (end_of_stream). Parse (``extproc.parse``), bound and classify
   (``extproc.classify``); a bad request gets its 4xx as an ImmediateResponse.
3. Admission (``extproc.gate``). Admitted at once, or queued: then we first send
   ``override_message_timeout`` so Envoy's short message timeout does not fire while we wait,
   and keep reading the stream so that a client who leaves is dropped from the queue at once.
   Queue full or evicted at the deadline: ImmediateResponse 429 with Retry-After.
4. Admitted: answer the body message with CONTINUE, the rewritten body (if max_tokens changed)
   and its content-length, and headers for the backend and the access log.
5. Hold: keep reading until Envoy ends the stream (it does so when the HTTP stream is done,
   after the last byte of the response) or cancels it (client gone). Then the slot goes back.

The slot is released in one ``finally`` and the request's single ``Outcome`` is recorded in the
same place, whatever ended the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from extproc.classify import Classification, MaxTokensAction, TokenCounter, classify, token_counter
from extproc.errors import Outcome, Rejection, RequestError, queue_rejection
from extproc.gate import Gate, Refused, Slot, Waiter
from extproc.metrics import NO_BUCKET, Metrics
from extproc.parse import Endpoint, check_content_headers, endpoint_for_path, parse_body
from extproc.policy import Policy

__all__ = ["MESSAGE_TIMEOUT_MARGIN_S", "ExtProcService"]

log = logging.getLogger("extproc.server")

# The message-timeout override sent while queued is the bucket's queue timeout plus this margin,
# so our own eviction (a 429 with Retry-After) always fires before Envoy's 504. Envoy's
# max_message_timeout must be at least the longest queue_timeout plus this margin.
MESSAGE_TIMEOUT_MARGIN_S = 1.0

_EOF = grpc.aio.EOF
_Context = grpc.aio.ServicerContext[Any, Any]

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


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # raw_value, not value: Envoy sends and expects raw bytes (ENVOY_NOTES).
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _immediate(rejection: Rejection, details: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=rejection.status),
            headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in rejection.headers()]),
            body=rejection.body,
            details=details,
        )
    )


def _admit(cls: Classification, queue_s: float) -> pb.ProcessingResponse:
    set_headers = [
        _header("x-llm-bucket", cls.bucket.name),
        _header("x-llm-queue-ms", str(round(queue_s * 1000))),
        _header("x-llm-prompt-tokens", str(cls.prompt_tokens)),
        # Echoed to the client by the route's response_headers_to_add (%REQ(x-llm-max-tokens)%),
        # which spares us a round trip on the response path.
        _header("x-llm-max-tokens", str(cls.max_tokens)),
    ]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
    if cls.new_body is not None:
        common.body_mutation.body = cls.new_body
        common.header_mutation.set_headers.append(
            _header("content-length", str(len(cls.new_body)))
        )
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


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
    """What one request's stream has reached, for the single outcome recorded at its end."""

    __slots__ = ("arrived_at", "bucket", "decided_at", "outcome", "slot", "waiter")

    def __init__(self) -> None:
        self.bucket = NO_BUCKET
        self.outcome: Outcome | None = None
        self.arrived_at: float | None = None
        self.decided_at: float | None = None
        self.slot: Slot | None = None
        self.waiter: Waiter | None = None


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, policy: Policy, gate: Gate, metrics: Metrics) -> None:
        self._policy = policy
        self._count: TokenCounter = token_counter(policy.tokens)
        self._gate = gate
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._max_tokens_children = {
            a: metrics.max_tokens_actions.labels(str(a)) for a in MaxTokensAction
        }

    async def Process(
        self, request_iterator: object, context: _Context
    ) -> None:
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

        st = _Stream()
        try:
            await self._handle(context, msg, headers, endpoint, st)
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
        loop = self._loop
        try:
            check_content_headers(headers.get("content-type"), headers.get("content-encoding"))
            if msg.request_headers.end_of_stream:
                raise RequestError(
                    400, "empty_body", "The request body is empty; send a JSON object."
                )
        except RequestError as e:
            await self._reject(context, st, e.outcome, e.rejection(), e.code)
            return
        await context.write(_HEADERS_CONTINUE)

        body = await self._read_body(context)
        if body is None:
            return  # stream ended before the body: CANCELLED_BEFORE_BODY
        st.arrived_at = loop.time()
        try:
            parsed = parse_body(endpoint, body)
            cls = classify(self._policy, self._count, headers, parsed)
        except RequestError as e:
            await self._reject(context, st, e.outcome, e.rejection(), e.code)
            return
        self._metrics.prompt_tokens.observe(cls.prompt_tokens)
        self._max_tokens_children[cls.max_tokens_action].inc()
        st.bucket = cls.bucket.name

        timeout = cls.bucket.queue_timeout_s
        try:
            entry = self._gate.enter(cls.bucket.name, timeout)
        except Refused as r:
            await self._refuse(context, st, r, timeout)
            return
        pending_read: asyncio.Future[object] | None = None
        if isinstance(entry, Waiter):
            st.waiter = entry
            await context.write(_timeout_override(timeout + MESSAGE_TIMEOUT_MARGIN_S))
            pending_read, slot = await self._wait(context, st, entry)
            if slot is None:
                return  # left the queue: evicted (answered) or the stream ended
            st.waiter = None
        else:
            slot = entry
        st.slot = slot
        st.decided_at = loop.time()
        await context.write(_admit(cls, slot.queue_s))

        # Hold the slot until Envoy ends the stream.
        while True:
            if pending_read is not None:
                nxt, pending_read = await pending_read, None
            else:
                nxt = await context.read()
            if nxt is _EOF:
                return
            await context.write(_continue_for(nxt))

    async def _wait(
        self, context: _Context, st: _Stream, waiter: Waiter
    ) -> tuple[asyncio.Future[object] | None, Slot | None]:
        """Wait for a slot while watching the stream. Returns the read still pending (to be
        awaited by the hold loop) and the slot, or (None, None) when the request left the
        queue."""
        task = asyncio.current_task()
        assert task is not None
        stream_ended = False

        def on_read(_: asyncio.Future[object]) -> None:
            # Envoy half-closed or sent something while we were queued: the stream is over
            # for us. Take the waiter out of the queue now.
            nonlocal stream_ended
            stream_ended = True
            task.cancel()

        read: asyncio.Future[object] = asyncio.ensure_future(context.read())
        read.add_done_callback(on_read)
        try:
            slot = await waiter.admitted()
        except Refused as r:
            read.remove_done_callback(on_read)
            read.cancel()
            limit = waiter.ticket.deadline - waiter.ticket.enqueued_at
            await self._refuse(context, st, r, limit)
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

    async def _reject(
        self,
        context: _Context,
        st: _Stream,
        outcome: Outcome,
        rejection: Rejection,
        details: str,
    ) -> None:
        st.outcome = outcome
        st.decided_at = self._loop.time()
        await context.write(_immediate(rejection, f"llm_extproc_{details}"))

    async def _refuse(
        self, context: _Context, st: _Stream, r: Refused, limit_s: float
    ) -> None:
        st.waiter = None
        rejection = queue_rejection(
            r.outcome,
            bucket=r.bucket,
            retry_after_s=r.retry_after_s,
            queued=r.queued,
            waited_s=r.waited_s,
            limit_s=limit_s,
        )
        await self._reject(context, st, r.outcome, rejection, str(r.outcome))

    async def _pass_through(
        self, context: _Context, first: pb.ProcessingRequest | None
    ) -> None:
        if first is not None:
            await context.write(_continue_for(first))
        while (msg := await context.read()) is not _EOF:
            await context.write(_continue_for(msg))

    # --- the one place a request is finished ---------------------------------------------------

    def _finish(self, st: _Stream) -> None:
        if st.slot is not None:
            st.slot.release()
        if st.waiter is not None:
            st.waiter.cancel()
        outcome = st.outcome
        if outcome is None:
            if st.slot is not None:
                outcome = Outcome.ADMITTED
            elif st.arrived_at is not None:
                outcome = Outcome.CANCELLED_WHILE_QUEUED
            else:
                outcome = Outcome.CANCELLED_BEFORE_BODY
        now = self._loop.time()
        start = st.arrived_at if st.arrived_at is not None else now
        end = st.decided_at if st.decided_at is not None else now
        self._metrics.finish(st.bucket, outcome, max(0.0, end - start))
