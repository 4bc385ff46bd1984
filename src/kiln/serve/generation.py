"""One HTTP request's work in the engine, shared by chat and completions.

A `Generation` holds one `RequestState` per prompt (each fanned out into n engine requests)
over one `OutputStream`. Lifecycle: `start()` validates every prompt against the engine's
limits and submits all engine requests at once (or raises: 400, 429, 503, nothing sent);
iterate `deltas()` for what each choice gained per delivered batch; `close()` always (it
aborts whatever is unfinished, e.g. after a client disconnect, and records metrics once).

`prompt_only` runs each prompt for one token with prompt logprobs and then reports no output
tokens at all: `/v1/completions` with `max_tokens=0` (lm-evaluation-harness log-likelihood).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.cluster.engine_client import OutputStream, RequestRejected
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.limits import RequestError, validate_request
from kiln.engine.output_processor import RequestState, SequenceDelta
from kiln.sampling_params import RepetitionGuardParams, SamplingParams, StructuredOutputsParams
from kiln.serve.context import ServeContext
from kiln.serve.errors import APIError, as_api_error, bad_request
from kiln.serve.protocol import SamplingRequest, SpeculativeUsage, Usage
from kiln.serve.usage import TokenCounts, make_usage
from kiln.structured.gateway import from_response_format

DONE = b"data: [DONE]\n\n"
# engine reason -> API reason: OpenAI's values, so typed clients accept every response; why the
# repetition guard stopped a request goes in `stop_reason` ("repetition", vLLM's field)
FINISH_REASONS = {"stop": "stop", "length": "length", "repetition": "stop", "abort": "abort"}


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the prompt's text when the client sent text (for echo)


@dataclass
class Choice:
    """A delta of one choice; `index` = prompt index x n + sequence index."""

    index: int
    prompt: int
    delta: SequenceDelta

    @property
    def finish_reason(self) -> str | None:
        return openai_finish_reason(self.delta.finish_reason)

    @property
    def stop_reason(self) -> int | str | None:
        return openai_stop_reason(self.delta.finish_reason, self.delta.stop_reason)


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reason in OpenAI's vocabulary (a guard stop is "stop")."""
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def openai_stop_reason(reason: str | None, stop_reason: int | str | None) -> int | str | None:
    """`stop_reason` on the wire: the matched stop string or token id, or "repetition" when
    the repetition guard ended the sequence."""
    return "repetition" if reason == "repetition" else stop_reason


class Generation:
    def __init__(self, ctx: ServeContext, request_id: str, prompts: list[Prompt],
                 params: SamplingParams, priority: int = 0, prompt_only: bool = False,
                 prompt_param: str = "prompt", cache_salt: str | None = None):
        self.ctx, self.request_id, self.prompts = ctx, request_id, prompts
        self.params, self.priority, self.prompt_only = params, priority, prompt_only
        self.prompt_param = prompt_param
        self.cache_salt = cache_salt  # the tenant's (kiln.serve.auth), never the client's
        self.states: list[RequestState] = []
        self.stream: OutputStream | None = None
        self._owner: dict[str, tuple[int, RequestState]] = {}
        self._arrival = time.monotonic()
        self._first_token: float | None = None
        self._last_token: dict[str, float] = {}
        self._closed = False
        self.num_guard_redraws = 0  # tokens the repetition guard dropped and sampled again

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        ctx.check_available()
        for p in self.prompts:
            self._validate(p.token_ids)
        for i, p in enumerate(self.prompts):
            state = RequestState.create(f"{self.request_id}-{i}", p.token_ids, self.params,
                                        ctx.frontend.tokenizer, self.priority, self.cache_salt)
            self.states.append(state)
            self._owner.update({rid: (i, state) for rid in state.sequences})
        if len(self._owner) > ctx.client.capacity:
            raise bad_request(f"the request needs {len(self._owner)} sequences; the server "
                              f"admits at most {ctx.client.capacity}", param="n")
        self.stream = ctx.client.submit([r for s in self.states for r in s.engine_requests])

    def _validate(self, token_ids: list[int]) -> None:
        try:
            validate_request(self.ctx.client.limits, token_ids, self.params)
        except RequestError as exc:
            param = self.prompt_param if exc.param == "prompt" else exc.param
            raise APIError(400, str(exc), param, exc.code) from exc

    def close(self) -> None:
        """Abort unfinished sequences and record this request's metrics (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.stream is not None:
            self.stream.close()
        self._record()

    # -- outputs ------------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[list[Choice]]:
        """Per delivered batch: the choices that changed. Raises (as the client raised)
        WorkerLost / RequestRejected if the engine loses or refuses the request."""
        assert self.stream is not None, "start() first"
        async for batch in self.stream:
            choices = self._absorb(batch)
            if choices:
                yield choices

    def _absorb(self, batch: list[EngineCoreOutput]) -> list[Choice]:
        touched: dict[str, tuple[int, RequestState]] = {}
        for out in batch:
            owner = self._owner[out.request_id]
            if out.finish_reason == "error":  # e.g. its grammar failed in the worker
                raise RequestRejected(out.stop_reason or "the engine failed the request",
                                      None, "engine_error")
            if out.num_redraws:  # constrained requests mask instead (kiln.structured.hooks)
                action = "retry" if self.params.structured_outputs is None else "mask"
                self.ctx.metrics.guard_trips.labels(action).inc(out.num_redraws)
                self.num_guard_redraws += out.num_redraws
            if owner[1].absorb(out):  # a stop string ended it before the engine did
                self.stream.abort([out.request_id])
            touched[out.request_id] = owner
        now = time.monotonic()
        return [self._choice(rid, p, state, now) for rid, (p, state) in touched.items()]

    def _choice(self, rid: str, p: int, state: RequestState, now: float) -> Choice:
        seq = state.sequences[rid]
        delta = seq.take_delta()
        if self.prompt_only:
            delta = SequenceDelta(seq.index, "", [], None, "length" if seq.finished else None,
                                  None)
        if delta.token_ids:
            self._observe_tokens(rid, now)
        return Choice(p * self.params.n + seq.index, p, delta)

    def _observe_tokens(self, rid: str, now: float) -> None:
        m = self.ctx.metrics
        if self._first_token is None:
            self._first_token = now
            m.ttft.observe(now - self._arrival)
        last = self._last_token.get(rid)
        if last is not None:
            m.itl.observe(now - last)
        self._last_token[rid] = now

    # -- accounting ---------------------------------------------------------------------------

    def counts(self) -> TokenCounts:
        """Prompt tokens once per prompt (not per choice); cached = the first child's hit."""
        total = TokenCounts()
        for state in self.states:
            seqs = state.ordered()
            completion = 0 if self.prompt_only else sum(len(s.token_ids) for s in seqs)
            total += TokenCounts(len(state.prompt_token_ids), seqs[0].num_cached_tokens,
                                 completion)
        return total

    def usage(self) -> Usage:
        usage = make_usage(self.counts(), self.ctx.pricing)
        usage.speculative = self.speculative_usage()
        usage.guard_redraws = self.num_guard_redraws or None
        usage.json_closing_steered = sum(s.num_closing_steered for s in self.states) or None
        return usage

    def speculative_usage(self) -> SpeculativeUsage | None:
        """Drafts verified and accepted over all choices (None when nothing was drafted)."""
        drafts = sum(s.num_draft_tokens for s in self.states)
        if not drafts:
            return None
        accepted = sum(s.num_accepted_tokens for s in self.states)
        steps = sum(s.num_verify_steps for s in self.states)
        return SpeculativeUsage(draft_tokens=drafts, accepted_tokens=accepted,
                                verify_steps=steps, mean_accepted_length=accepted / steps)

    def _per_position(self, field: str) -> list[int]:
        """A per-draft-position count summed over all choices."""
        total: list[int] = []
        for state in self.states:
            counts = getattr(state, field)
            total.extend([0] * (len(counts) - len(total)))
            for i, n in enumerate(counts):
                total[i] += n
        return total

    def _record(self) -> None:
        m, counts = self.ctx.metrics, self.counts()
        m.e2e.observe(time.monotonic() - self._arrival)
        m.prompt_tokens.inc(counts.prompt)
        m.cached_tokens.inc(counts.cached)
        m.generation_tokens.inc(counts.completion)
        m.cost.inc(self.ctx.pricing.cost(counts))
        spec = self.speculative_usage()
        if spec is not None:
            m.spec_drafts.inc(spec.draft_tokens)
            m.spec_accepted.inc(spec.accepted_tokens)
            m.spec_verify_steps.inc(spec.verify_steps)
            for counter, field in ((m.spec_drafted_per_pos, "drafted_per_position"),
                                   (m.spec_accepted_per_pos, "accepted_per_position")):
                for position, n in enumerate(self._per_position(field)):
                    counter.labels(str(position)).inc(n)
            for state in self.states:
                for source, (drafted, accepted) in state.drafts_by_source.items():
                    m.spec_drafted_by_source.labels(source).inc(drafted)
                    m.spec_accepted_by_source.labels(source).inc(accepted)
        for state in self.states:
            for seq in state.sequences.values():
                reason = seq.finish_reason or "abort"  # kiln's own ("repetition" included)
                m.finished.labels(reason).inc()
                if reason == "repetition":
                    m.guard_trips.labels("stop").inc()
                if seq.num_closing_steered:
                    m.structured_closings.inc()


# -- request -> sampling params ----------------------------------------------------------------

def sampling_params(req: SamplingRequest, ctx: ServeContext, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the shared request fields (SamplingParamsError -> 400 upstream)."""
    if req.n > ctx.config.max_n:
        raise bad_request(f"n must be <= {ctx.config.max_n}, got {req.n}", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        n=req.n, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0), min_p=_or(req.min_p, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0), seed=req.seed, stop=stop,
        ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs(req), repetition_guard=repetition_guard(req))


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """`response_format` (OpenAI) or `structured_outputs` (kiln/vLLM), at most one."""
    so, rf = req.structured_outputs, req.response_format
    if so is not None and rf is not None and rf.type != "text":
        raise bad_request("give response_format or structured_outputs, not both",
                          param="structured_outputs")
    if rf is not None:
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if rf.type == "json_schema" and rf.json_schema is None:
            raise bad_request("response_format json_schema needs json_schema",
                              param="response_format")
        return from_response_format(rf.type, schema)
    if so is None:
        return None
    tag = so.structural_tag
    return StructuredOutputsParams(
        json=so.json_ if so.json_ is None or isinstance(so.json_, str) else
        json.dumps(so.json_, ensure_ascii=False), regex=so.regex, choice=so.choice,
        grammar=so.grammar, json_object=bool(so.json_object),
        structural_tag=tag if tag is None or isinstance(tag, str) else json.dumps(tag),
        disable_any_whitespace=so.disable_any_whitespace)


def repetition_guard(req: SamplingRequest) -> RepetitionGuardParams | None:
    guard = req.repetition_guard
    if guard is None or isinstance(guard, str):
        return None if guard is None else RepetitionGuardParams(mode=guard)
    return RepetitionGuardParams(**guard.model_dump())


async def check_grammar(ctx: ServeContext, params: SamplingParams, param: str) -> None:
    """Compile the request's grammar before admission: a bad or too expensive one is a 400
    naming `param` (kiln.structured.gateway; cached grammars cost microseconds)."""
    if params.structured_outputs is not None:
        await ctx.structured.validate(params.structured_outputs, ctx.client.limits.vocab_size,
                                      param)


def _or(value, default):
    return default if value is None else value


def check_top_logprobs(value: int | None, ctx: ServeContext, param: str) -> None:
    cap = ctx.config.max_top_logprobs
    if value is not None and value > cap:
        raise bad_request(f"{param} must be <= {cap}, got {value}", param=param)


# -- transport helpers ---------------------------------------------------------------------------

def sse(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json(exclude_none=True).encode() + b"\n\n"


class GenerationStream(StreamingResponse):
    """The SSE response of a Generation: `body`'s events through `event_stream`, and the
    Generation closed however the response ends (also when the client leaves before the
    first byte, when the body generator never starts and its `finally` never runs)."""

    def __init__(self, gen: Generation, body: AsyncIterator[bytes]):
        super().__init__(event_stream(gen, body), media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


async def event_stream(gen: Generation, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The SSE body: `body`'s events, then `data: [DONE]`. A failure after the headers went
    out becomes one error event before [DONE]. A client disconnect cancels this generator,
    and `close()` aborts the request in the engine."""
    try:
        async for piece in body:
            yield piece
    except Exception as exc:
        error = as_api_error(exc)
        gen.ctx.metrics.http_errors.labels(str(error.status)).inc()
        yield error.sse_event()
    finally:
        gen.close()
    yield DONE


async def run_to_end(gen: Generation, request: Request) -> bool:
    """Consume every delta; False if the client disconnected first (the request is then
    aborted). Raises what the generation raised."""

    async def consume() -> None:
        async for _ in gen.deltas():
            pass

    try:
        return await _unless_disconnected(request, consume())
    finally:
        gen.close()


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        return False
    task.result()
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
