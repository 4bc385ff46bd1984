"""POST /v1/completions: a string, a list of strings, a token-id list or a list of those.

Each prompt becomes one request with n choices; choice index = prompt index x n + i.
`echo` prepends the prompt (its text, and with `logprobs` its tokens' logprobs; the first prompt
token has none). `max_tokens=0` runs the prompt only: the engine computes one token with
prompt logprobs and that token is dropped, so `echo=true, max_tokens=0, logprobs=k` returns
the prompt's log-likelihood as lm-evaluation-harness `local-completions` expects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from kiln.engine.contract import TokenLogprobs
from kiln.engine.output_processor import OutputSequence
from kiln.sampling_params import SamplingParams
from kiln.serve.auth import tenant_salt
from kiln.serve.context import ServeContext, new_request_id
from kiln.serve.errors import bad_request
from kiln.serve.frontend import Frontend
from kiln.serve.generation import (
    Choice,
    Generation,
    GenerationStream,
    Prompt,
    check_grammar,
    check_top_logprobs,
    openai_finish_reason,
    openai_stop_reason,
    run_to_end,
    sampling_params,
    sse,
)
from kiln.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)


async def create_completion(req: CompletionRequest, ctx: ServeContext,
                            request: Request) -> Response:
    ctx.check_model(req.model)
    ctx.check_available()
    _check_supported(req)
    prompt_only = req.max_tokens == 0
    params = _params(req, ctx, prompt_only)
    await check_grammar(ctx, params, "response_format" if req.response_format
                        else "structured_outputs")
    gen = Generation(ctx, new_request_id("cmpl"), _prompts(req, ctx.frontend), params,
                     req.priority, prompt_only=prompt_only, cache_salt=tenant_salt(request))
    gen.start()
    view = _View(gen, req)
    if req.stream:
        return GenerationStream(gen, view.chunks())
    if not await run_to_end(gen, request):
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(view.response().model_dump())


def _check_supported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (kiln does not rank candidates)",
                          param="best_of")
    if req.max_tokens == 0 and req.min_tokens:
        raise bad_request("min_tokens must be 0 when max_tokens is 0", param="min_tokens")


def _prompts(req: CompletionRequest, frontend: Frontend) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        return [Prompt(frontend.encode(p), p)]
    if isinstance(p[0], str):
        return [Prompt(frontend.encode(text), text) for text in p]
    if isinstance(p[0], int):
        return [Prompt(list(p))]
    return [Prompt(list(ids)) for ids in p]


def _params(req: CompletionRequest, ctx: ServeContext, prompt_only: bool) -> SamplingParams:
    check_top_logprobs(req.logprobs, ctx, "logprobs")
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    if prompt_only:  # one token is computed (and dropped): the engine always samples
        return sampling_params(req, ctx, max_tokens=1, logprobs=None, prompt_logprobs=prompt_lp)
    return sampling_params(req, ctx, max_tokens=req.max_tokens, logprobs=req.logprobs,
                           prompt_logprobs=prompt_lp)


class _Logprobs:
    """Builds one choice's legacy `logprobs` object, token by token."""

    def __init__(self, frontend: Frontend, top_n: int, offset: int = 0):
        self.frontend, self.top_n, self.offset = frontend, top_n, offset
        self.out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                      text_offset=[])

    def add(self, token_ids: list[int], entries: list[TokenLogprobs | None]) -> _Logprobs:
        text_of = self.frontend.token_text
        for tid, e in zip(token_ids, entries, strict=False):
            text = text_of(tid)
            self.out.tokens.append(text)
            self.out.text_offset.append(self.offset)
            self.offset += len(text)
            self.out.token_logprobs.append(None if e is None else e.logprob)
            top = None
            if e is not None:
                top = {text_of(t): lp for t, lp in zip(e.top_ids[:self.top_n], e.top_logprobs,
                                                       strict=False)}
                top.setdefault(text, e.logprob)
            self.out.top_logprobs.append(top)
        return self


class _View:
    """Formats one Generation as completion responses or stream chunks."""

    def __init__(self, gen: Generation, req: CompletionRequest):
        self.gen, self.req = gen, req
        self.frontend = gen.ctx.frontend
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _echo_text(self, p: int) -> str:
        prompt = self.gen.prompts[p]
        return prompt.text if prompt.text is not None else self.frontend.decode(prompt.token_ids)

    def _echo_logprobs(self, p: int, lp: _Logprobs) -> None:
        state = self.gen.states[p]
        entries = [None, *(state.prompt_logprobs or [])]
        entries += [None] * (len(state.prompt_token_ids) - len(entries))
        lp.add(state.prompt_token_ids, entries)

    # -- whole response ---------------------------------------------------------------------

    def response(self) -> CompletionResponse:
        choices = [self._choice(p, seq) for p, state in enumerate(self.gen.states)
                   for seq in state.ordered()]
        return CompletionResponse(id=self.gen.request_id, created=self.gen.ctx.created,
                                  model=self.gen.ctx.model_name, choices=choices,
                                  usage=self.gen.usage())

    def _choice(self, p: int, seq: OutputSequence) -> CompletionChoice:
        echo = self._echo_text(p) if self.req.echo else ""
        text = "" if self.gen.prompt_only else seq.text
        logprobs = None
        if self.req.logprobs is not None:
            lp = _Logprobs(self.frontend, self.req.logprobs)
            if self.req.echo:
                self._echo_logprobs(p, lp)
            if not self.gen.prompt_only:
                lp.offset = len(echo)
                lp.add(seq.token_ids, list(seq.logprobs or []))
            logprobs = lp.out
        return CompletionChoice(index=p * self.req.n + seq.index, text=echo + text,
                                logprobs=logprobs,
                                finish_reason=openai_finish_reason(seq.finish_reason),
                                stop_reason=openai_stop_reason(seq.finish_reason,
                                                               seq.stop_reason))

    # -- stream -----------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[bytes]:
        async for choices in self.gen.deltas():
            yield b"".join(self._chunk(c) for c in choices)
        opts = self.req.stream_options
        if opts and opts.include_usage:
            yield sse(self._wrap([], usage=True))

    def _chunk(self, c: Choice) -> bytes:
        text, lp = "", None
        if self.req.logprobs is not None:
            lp = _Logprobs(self.frontend, self.req.logprobs, self._offsets.get(c.index, 0))
        if self.req.echo and c.index not in self._echoed:
            self._echoed.add(c.index)
            text = self._echo_text(c.prompt)
            if lp is not None:
                self._echo_logprobs(c.prompt, lp)
                lp.offset = len(text)
        text += c.delta.text
        if lp is not None:
            lp.add(c.delta.token_ids, list(c.delta.logprobs or []))
            self._offsets[c.index] = lp.offset
        if not (text or c.finish_reason or (lp and lp.out.tokens)):
            return b""
        return sse(self._wrap([CompletionChoice(
            index=c.index, text=text, logprobs=lp.out if lp else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)]))

    def _wrap(self, choices: list[CompletionChoice], usage: bool = False) -> CompletionResponse:
        return CompletionResponse(id=self.gen.request_id, created=self.gen.ctx.created,
                                  model=self.gen.ctx.model_name, choices=choices,
                                  usage=self.gen.usage() if usage else None)
