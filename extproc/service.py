"""The servicer: Envoy's ext_proc stream in, CONTINUE or an immediate answer out.

It only wires the stages of ``extproc.request`` and ``extproc.pool`` together. It needs
two things of a stream, ``await read()`` and ``await write(msg)``, so it runs on either gRPC
transport (``extproc.transport.h2``, the default, or grpc.aio; see ``extproc.app``).

Life of one request (Envoy 1.40 with ``extproc.contract.PROCESSING_MODE``: request headers
SEND, request body BUFFERED, nothing of the response; docs/envoy.md):

1. ``request_headers``. Not a POST to /v1/chat/completions or /v1/completions: answer CONTINUE
   with a mode override that skips the body, then CONTINUE to anything else until the stream
   ends; nothing is queued or counted. Otherwise refuse unreadable encodings (415) or a
   missing body (400) at once, else CONTINUE and wait for the body. The route's metadata
   (``extproc.request.routes``) arrives on this message.
2. ``request_body`` (end_of_stream). Parse (``request.parse``), bound and classify
   (``request.classify``); a bad request gets its 4xx as an ImmediateResponse.
3. Admission (``pool.gate``) as ``request.deadline.plan`` plans it. Admitted at once, or queued:
   then first send ``override_message_timeout`` so Envoy's short message timeout does not fire
   while we wait, and keep reading the stream so that a client who leaves is dropped from the queue
   at once. Queue full, evicted at the deadline, or expired at the client's own sooner one
   (``extproc.request.deadline``): ImmediateResponse 429 with Retry-After.
4. Admitted: answer the body message (``request.respond.admitted``).
5. Hold: keep reading until Envoy ends the stream (it does so when the HTTP stream is done,
   after the last byte of the response) or cancels it (client gone). Then the slot goes back.

Shadow mode (``mode: shadow``): the same decisions are taken and counted, but every request is
let through unchanged and at once; what enforcement would have done is the request's
``shadow_outcome``. A request that would have queued keeps a virtual place in its bucket's
queue, so would-be evictions and queue-full refusals are counted as under enforcement; a task
waits on that place, but the stream owns it (``State.waiter``), so it is left in the same
``finally`` even when the stream ends before the task has run.

The slot is released in one ``finally``, where the request is also counted and logged, once,
whatever ended the stream. Its ``Outcome`` is assigned by ``RequestRecord.decide`` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import stream
from extproc.config.policy import Mode, Policy
from extproc.contract import MESSAGE_TIMEOUT_MARGIN_S
from extproc.ops.logs import log_finished
from extproc.ops.metrics import Metrics
from extproc.outcome import Outcome, Rejection, RequestError, queue_rejection
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Refused, Slot, Waiter
from extproc.pool.shares import Share, Shares
from extproc.record import NO_BUCKET, RequestRecord
from extproc.request import respond
from extproc.request.classify import Classification, TokenCounter, token_counter
from extproc.request.deadline import NO_DEADLINE, Deadline, abandoned, deadline_of, plan
from extproc.request.endpoints import Endpoint, canonical, endpoint_for_path, refused_api
from extproc.request.offload import INLINE_BODY_BYTES, Busy, Offload, Parsed, parse_and_classify
from extproc.request.parse import check_content_headers
from extproc.request.routes import Route, RouteCache
from extproc.request.tenant import NO_TENANT, Tenant, tenant_of

__all__ = ["ExtProcService"]

log = logging.getLogger("extproc.service")


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, policy: Policy, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._shares = Shares(policy)
        self._routes = RouteCache(on_clear=self._shares.forget_routes)
        self._offload = Offload()
        self._deadline_logged: set[str] = set()  # deadline headers with a bad value, logged
        self.apply_policy(policy)

    def apply_policy(self, policy: Policy) -> None:
        """Switch to a new policy: the next request uses it. Raises if it cannot be used
        (e.g. its tokenizer file does not load); then nothing changes."""
        count: TokenCounter = token_counter(policy.tokens)
        self._gate.reconfigure(policy)
        self._shares.reconfigure(policy)
        self._metrics.declare(policy.buckets)
        self._policy, self._count = policy, count
        self._routes.clear()  # route overrides are validated against the policy

    @property
    def policy(self) -> Policy:
        return self._policy

    def stop_admitting(self) -> None:
        """The sidecar is stopping: requests waiting for a route share get 503, like those
        waiting in a bucket (``Gate.close``)."""
        self._shares.close()

    def close(self) -> None:
        """Stop the worker that parses large bodies (the sidecar has stopped)."""
        self._offload.close()

    def route_shares(self) -> dict[str, dict[str, int]]:
        """Each live route share: capacity, in flight, queued (for /debug/queues)."""
        return self._shares.statistics()

    async def Process(self, request_iterator: object, context: stream.Stream) -> None:
        try:
            msg = await context.read()
        except asyncio.CancelledError:
            self._finish(stream.State(RequestRecord("")))  # see below
            raise
        if msg is stream.EOF:
            # Envoy opens the stream when a request for an LLM route arrives (every other
            # route skips ext_proc) and cancels it when the client leaves, possibly before it
            # sent the headers: one request, counted once, as having left before its body.
            self._finish(stream.State(RequestRecord("")))
            return
        if msg.WhichOneof("request") != "request_headers":
            await context.write(respond.continue_for(msg))
            await stream.hold(context, None)
            return
        headers = stream.headers_of(msg.request_headers)
        method, path = headers.get(":method", ""), headers.get(":path", "")
        endpoint = endpoint_for_path(method, path)
        if endpoint is None or endpoint not in self._policy.endpoints:
            # LLM work the sidecar cannot bound, or the policy does not admit: refused, never
            # passed. Anything else passes uncounted.
            api = refused_api(method, path) if endpoint is None else canonical(path)
            if api is not None:
                await self._refuse_api(context, headers.get("x-request-id", ""), api)
                return
            await context.write(respond.PASS_THROUGH)
            await stream.hold(context, None)
            return

        anthropic = endpoint is Endpoint.MESSAGES
        st = stream.State(RequestRecord(headers.get("x-request-id", ""), anthropic=anthropic))
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

    # --- one request on the admitted path ------------------------------------------------------

    async def _handle(
        self,
        context: stream.Stream,
        msg: pb.ProcessingRequest,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        st: stream.State,
    ) -> None:
        policy, rec = self._policy, st.rec
        shadow = policy.mode is Mode.SHADOW
        route = self._route(msg, policy)
        st.deadline = self._deadline(headers, policy, route)
        no_body = msg.request_headers.end_of_stream
        try:
            check_content_headers(headers.get("content-type"), headers.get("content-encoding"))
            if no_body:
                raise RequestError("empty_body", "The request body is empty; send a JSON object.")
        except RequestError as e:
            if not shadow or no_body:
                await self._refuse(context, rec, e.outcome, e.rejection())
                return
            self._note_shadow(rec, e.outcome, e.code)
        await context.write(respond.HEADERS_CONTINUE)

        body = await stream.read_body(context)
        if body is None:
            return  # the stream ended before the body: CANCELLED_BEFORE_BODY
        rec.arrived_at = self._loop.time()
        cls: Classification | None = None
        if rec.shadow_outcome is None:  # (in shadow mode an unreadable body is let through)
            try:
                parsed = await self._parse(context, st, policy, headers, endpoint, body, route)
                rec.stream = parsed.stream
                cls = parsed.classification
            except RequestError as e:
                if not shadow:
                    await self._refuse(context, rec, e.outcome, e.rejection())
                    return
                self._note_shadow(rec, e.outcome, e.code)
            except Busy:
                busy = queue_rejection(
                    Outcome.REJECTED_BUSY,
                    bucket=NO_BUCKET,
                    retry_after_s=policy.retry_after.min_s,
                    queued=self._offload.pending,
                )
                if not shadow:
                    await self._refuse(context, rec, Outcome.REJECTED_BUSY, busy)
                    return
                self._note_shadow(rec, Outcome.REJECTED_BUSY, busy.code)
        # A queued request may wait long, thousands at once: keep only the classification.
        # Its body is still held (by Envoy, and by us when rewritten): count its size.
        size = len(body)
        tenant = tenant_of(cls.bucket.tenant, headers) if cls is not None else NO_TENANT
        del msg, headers, body
        if shadow:
            await self._shadow(context, st, cls, size, tenant)
        else:
            assert cls is not None
            await self._enforce(context, st, cls, size, route.share, tenant)

    async def _parse(
        self,
        context: stream.Stream,
        st: stream.State,
        policy: Policy,
        headers: Mapping[str, str],
        endpoint: Endpoint,
        body: bytes,
        route: Route,
    ) -> Parsed:
        """Parse and classify: on the loop for ordinary bodies, in the worker for large ones.

        The worker may take longer than Envoy's message timeout, so Envoy's timeout is
        extended first, once, to the longest wait the request could have; the time the parse
        takes then comes off the request's queue deadline (``st.answer_by``), and a parse still
        waiting for the worker by then is answered 429 ``busy``: our own answer always comes
        before Envoy gives up."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse_and_classify(policy, self._count, headers, endpoint, body, route.override)
        longest = policy.longest_queue_timeout_s
        if route.override is not None and route.override.queue_timeout_s is not None:
            longest = max(longest, route.override.queue_timeout_s + policy.longest_relegation_s)
        st.overridden = True
        st.answer_by = self._loop.time() + longest
        await context.write(respond.timeout_override(longest + MESSAGE_TIMEOUT_MARGIN_S))
        job = self._offload.parse(policy, self._count, headers, endpoint, body, route.override)
        try:
            return await asyncio.wait_for(job, longest)
        except TimeoutError:  # the worker is too far behind: answer before Envoy gives up
            raise Busy from None

    async def _enforce(
        self,
        context: stream.Stream,
        st: stream.State,
        cls: Classification,
        size: int,
        share: Share | None,
        tenant: Tenant,
    ) -> None:
        rec = st.rec
        rec.classified(cls)
        wait = plan(cls, st.deadline, st.answer_by, size, tenant, self._policy, self._loop.time())
        entry, limit = wait.entry, wait.limit_s
        read: asyncio.Future[Any] | None = None
        if share is not None:  # first a place in the route's own share of the bucket
            st.share = share
            got = await self._slot(context, st, share, entry, limit, read)
            if got is None:
                return
            st.share_slot, read = got
            if read is not None:  # it waited for the share: what is left of its wait
                entry = wait.remaining(self._loop.time())
        got = await self._slot(context, st, None, entry, limit, read)
        if got is None:
            return
        st.slot, read = got
        rec.relegated(st.slot.ticket.relegated_from, st.slot.ticket.bucket)
        rec.decide(Outcome.ADMITTED, self._loop.time())
        await context.write(respond.admitted(cls, rec))
        await stream.hold(context, read)

    async def _slot(
        self,
        context: stream.Stream,
        st: stream.State,
        share: Share | None,
        entry: Entry,
        limit_s: float,
        read: asyncio.Future[Any] | None,
    ) -> tuple[Slot, asyncio.Future[Any] | None] | None:
        """A slot of ``share`` (None: the bucket's) for ``entry``, now or after a wait that
        watches the stream, its read still pending; None if answered (refused, evicted) or gone."""
        try:
            entered = self._gate.enter(entry) if share is None else self._shares.enter(share, entry)
        except Refused as r:
            if read is not None:
                read.cancel()
            await self._refuse_queue(context, st.rec, r, limit_s)
            return None
        if isinstance(entered, Slot):
            return entered, read
        st.waiter = entered
        if not st.overridden:
            st.overridden = True
            await context.write(respond.timeout_override(limit_s + MESSAGE_TIMEOUT_MARGIN_S))
        read, slot = await self._wait(context, st.rec, entered, read, limit_s)
        st.waiter = None
        return None if slot is None else (slot, read)

    async def _shadow(
        self,
        context: stream.Stream,
        st: stream.State,
        cls: Classification | None,
        size: int,
        tenant: Tenant,
    ) -> None:
        """Shadow mode: take the decisions enforcement would, then let the request through."""
        if cls is not None:
            st.rec.classified(cls)
            try:  # as if it had no deadline of its own
                wait = plan(cls, NO_DEADLINE, None, size, tenant, self._policy, self._loop.time())
                entry = self._gate.enter(wait.entry)
            except Refused as r:
                self._note_shadow(st.rec, r.outcome, r.code)
            else:
                if isinstance(entry, Waiter):
                    # The place is the stream's (``_finish`` leaves it), not the task's: the
                    # stream may end before the task has run at all.
                    st.waiter = entry
                    st.shadow_task = asyncio.ensure_future(self._shadow_wait(st, entry))
                else:
                    st.slot = entry
        st.rec.decide(Outcome.ADMITTED, self._loop.time())
        await context.write(respond.admitted_unchanged(st.rec))
        await stream.hold(context, None)

    async def _wait(
        self,
        context: stream.Stream,
        rec: RequestRecord,
        waiter: Waiter,
        read: asyncio.Future[Any] | None,
        limit_s: float,
    ) -> tuple[asyncio.Future[Any] | None, Slot | None]:
        """Wait for a slot while watching the stream: Envoy half-closing or sending anything
        while we are queued means the stream is over for us. Returns the read still pending
        (for the hold loop) and the slot, or (None, None) when the request left the queue."""
        if read is None:
            read = asyncio.ensure_future(context.read())
        try:
            slot = await waiter.admitted_unless(read)
        except Refused as r:
            read.cancel()
            rec.relegated(r.relegated_from, r.bucket)
            await self._refuse_queue(context, rec, r, limit_s)
            return None, None
        except asyncio.CancelledError:
            read.cancel()
            raise
        return (read, slot) if slot is not None else (None, None)

    async def _shadow_wait(self, st: stream.State, waiter: Waiter) -> None:
        """Shadow mode: keep the request's virtual place in the queue while it runs."""
        try:
            st.slot = await waiter.admitted()  # released when the stream ends
        except Refused as r:
            self._note_shadow(st.rec, r.outcome, r.code)

    # --- refusals ----------------------------------------------------------------------------

    async def _refuse(
        self, context: stream.Stream, rec: RequestRecord, outcome: Outcome, rejection: Rejection
    ) -> None:
        rec.decide(outcome, self._loop.time(), rejection.code)
        await context.write(respond.refusal(rejection, rec))

    async def _refuse_api(self, context: stream.Stream, request_id: str, api: str) -> None:
        """Refuse a request for an API the sidecar cannot bound (``contract.LLM_PATHS``) or the
        policy does not admit (``endpoints``): 404 ``unsupported_endpoint``, counted as
        ``rejected_invalid``."""
        st = stream.State(RequestRecord(request_id))
        try:
            admitted = ", ".join(self._policy.endpoints)
            error = RequestError(
                "unsupported_endpoint",
                f"POST {api} is not admitted by this gateway; it admits these APIs: {admitted}.",
                status=404,
            )
            await self._refuse(context, st.rec, error.outcome, error.rejection())
        finally:
            self._finish(st)

    async def _refuse_queue(
        self, context: stream.Stream, rec: RequestRecord, r: Refused, limit_s: float
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

    def _note_shadow(self, rec: RequestRecord, outcome: Outcome, code: str | None) -> None:
        if rec.shadow_outcome is None:
            rec.shadow_outcome = outcome
            rec.code = code

    # --- deadlines -----------------------------------------------------------------------------

    def _deadline(self, headers: Mapping[str, str], policy: Policy, route: Route) -> Deadline:
        """The request's own deadline (``extproc.request.deadline``); an ignored header value
        is counted, and logged the first time per header name."""
        timeout = route.override.timeout_s if route.override is not None else None
        deadline = deadline_of(headers, policy.client_deadline, timeout, self._loop.time())
        for name, value in deadline.invalid:
            self._metrics.client_deadline_invalid.inc()
            if name not in self._deadline_logged:
                self._deadline_logged.add(name)
                log.warning(
                    "deadline header %s: %.64r is not a number >= 0, ignored "
                    "(counted in llm_extproc_client_deadline_invalid_total; logged once)",
                    name,
                    value,
                )
        return deadline

    # --- route metadata ----------------------------------------------------------------------

    def _route(self, msg: pb.ProcessingRequest, policy: Policy) -> Route:
        route = self._routes.lookup(msg.attributes, policy)
        if route.invalid:
            self._metrics.route_policy_errors.inc()
        return route

    # --- the one place a request is finished ---------------------------------------------------

    def _finish(self, st: stream.State) -> None:
        if st.shadow_task is not None and not st.shadow_task.done():
            st.shadow_task.cancel()  # (a task cancelled before it ran never cleans up itself)
        rec = st.rec
        rec.ended_at = self._loop.time()
        if st.slot is not None:
            gone = abandoned(st.deadline, rec.ended_at)  # ended after its client had left
            # Its client's own short deadline: counted as abandoned, not the limit's to judge.
            own = st.slot.ticket.client_deadline
            self._gate.ends.record(rec.ended_at, rec.hold_s or 0.0, gone, client_deadline=own)
            if gone:
                self._metrics.abandoned.labels(rec.bucket).inc()
            st.slot.release()
        if st.waiter is not None:
            st.waiter.cancel()
        if st.share is not None:
            if st.share_slot is not None:
                st.share_slot.release()
            self._shares.sweep(st.share)
        if rec.outcome is None:  # the client left before the sidecar answered
            left_while = (
                Outcome.CANCELLED_WHILE_QUEUED
                if rec.arrived_at is not None
                else Outcome.CANCELLED_BEFORE_BODY
            )
            rec.decide(left_while, rec.ended_at)
        self._metrics.finish(rec)
        log_finished(rec)
