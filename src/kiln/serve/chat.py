"""POST /v1/chat/completions: messages -> chat template -> one Generation -> OpenAI shapes.

Streams send, per choice, a first chunk with the assistant role, then one chunk per delivered
batch with the new text (and logprobs), the last carrying `finish_reason`; then, with
`stream_options.include_usage`, a chunk with empty `choices` and the usage; then [DONE].

Tools (kiln.structured): `tools` reach the chat template (or are written into the prompt), the
output is parsed into `tool_calls` (streamed as OpenAI streams them: id and name first, then
argument pieces), and finish_reason is "tool_calls" when a call ended the turn. tool_choice
required / a named function constrains decoding so the arguments always match the schema.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from kiln.engine.contract import TokenLogprobs
from kiln.sampling_params import StructuredOutputsParams
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
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionCallDelta,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from kiln.structured.gateway import ToolPlan, make_tool, plan_tools
from kiln.structured.parsers import CallDelta, ToolCallStream, parse_tool_calls


async def create_chat_completion(req: ChatCompletionRequest, ctx: ServeContext,
                                 request: Request) -> Response:
    ctx.check_model(req.model)
    ctx.check_available()
    plan = _tool_plan(req, ctx)
    params = _params(req, ctx, plan)
    prompt = ctx.frontend.chat_prompt(req.messages, tools=plan.template_tools if plan else None,
                                      tool_format=plan.fmt if plan else None)
    await check_grammar(ctx, params, "tools" if plan and plan.grammar else
                        "structured_outputs" if req.structured_outputs else "response_format")
    gen = Generation(ctx, new_request_id("chatcmpl"), [Prompt(prompt)], params, req.priority,
                     prompt_param="messages", cache_salt=tenant_salt(request))
    gen.start()
    if req.stream:
        return GenerationStream(gen, _chunks(gen, req, plan))
    if not await run_to_end(gen, request):
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(_response(gen, req, plan).model_dump())


def _params(req: ChatCompletionRequest, ctx: ServeContext, plan: ToolPlan | None):
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    check_top_logprobs(req.top_logprobs, ctx, "top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(req, ctx, max_tokens=max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    if plan is None or plan.grammar is None:
        return params
    if params.structured_outputs is not None:
        raise bad_request("tools (unless tool_choice is none) cannot be combined with "
                          "response_format or structured_outputs", param="tool_choice")
    special = plan.fmt.open_tag in getattr(ctx.frontend.tokenizer, "all_special_tokens", ())
    return params.clone(structured_outputs=StructuredOutputsParams(structural_tag=plan.grammar),
                        skip_special_tokens=params.skip_special_tokens and not special)


def _tool_plan(req: ChatCompletionRequest, ctx: ServeContext) -> ToolPlan | None:
    tools = [make_tool(t.function.name, t.function.description, t.function.parameters)
             for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    return plan_tools(tools, choice, req.parallel_tool_calls, ctx.config.tool_call_parser,
                      getattr(ctx.frontend.tokenizer, "chat_template", None))


def _response(gen: Generation, req: ChatCompletionRequest,
              plan: ToolPlan | None) -> ChatCompletionResponse:
    choices = []
    for seq in gen.states[0].ordered():
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(gen.ctx.frontend, seq.logprobs or [], req.top_logprobs)
        message, reason = ChatMessageOut(content=seq.text), seq.finish_reason
        if plan is not None and plan.parses:
            parsed = parse_tool_calls(seq.text, plan.fmt)
            calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name,
                                                                   arguments=c.arguments))
                     for c in parsed.calls]
            message = ChatMessageOut(content=parsed.content, tool_calls=calls or None)
            reason = _tool_finish_reason(reason, bool(calls))
        choices.append(ChatChoice(index=seq.index, message=message, logprobs=logprobs,
                                  finish_reason=openai_finish_reason(reason),
                                  stop_reason=openai_stop_reason(seq.finish_reason,
                                                                 seq.stop_reason)))
    return ChatCompletionResponse(id=gen.request_id, created=gen.ctx.created,
                                  model=gen.ctx.model_name, choices=choices, usage=gen.usage())


def _tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the turn ended (stop) with calls."""
    return "tool_calls" if called and reason == "stop" else reason


async def _chunks(gen: Generation, req: ChatCompletionRequest,
                  plan: ToolPlan | None) -> AsyncIterator[bytes]:
    yield b"".join(_chunk(gen, ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                        content="")))
                   for i in range(req.n))
    streams = {i: ToolCallStream(plan.fmt) for i in range(req.n)} \
        if plan is not None and plan.parses else None
    async for choices in gen.deltas():
        out = [_chunk_choice(c, gen, req, streams) for c in choices]
        yield b"".join(_chunk(gen, c) for c in out
                       if c.delta.content or c.delta.tool_calls or c.finish_reason
                       or c.logprobs)
    if req.stream_options and req.stream_options.include_usage:
        yield sse(ChatCompletionChunk(id=gen.request_id, created=gen.ctx.created,
                                      model=gen.ctx.model_name, choices=[], usage=gen.usage()))


def _chunk(gen: Generation, choice: ChatChunkChoice) -> bytes:
    return sse(ChatCompletionChunk(id=gen.request_id, created=gen.ctx.created,
                                   model=gen.ctx.model_name, choices=[choice]))


def _chunk_choice(c: Choice, gen: Generation, req: ChatCompletionRequest,
                  streams: dict[int, ToolCallStream] | None) -> ChatChunkChoice:
    logprobs = None
    if req.logprobs and c.delta.logprobs:
        logprobs = chat_logprobs(gen.ctx.frontend, c.delta.logprobs, req.top_logprobs)
    delta, reason = ChatDelta(content=c.delta.text or None), c.delta.finish_reason
    if streams is not None:
        stream = streams[c.index]
        found = stream.feed(c.delta.text)
        if reason is not None:
            rest = stream.finish()
            found.content += rest.content
            found.calls += rest.calls
            reason = _tool_finish_reason(reason, stream.num_calls > 0)
        delta = ChatDelta(content=found.content or None,
                          tool_calls=[_call_delta(d) for d in found.calls] or None)
    return ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs,
                           finish_reason=openai_finish_reason(reason),
                           stop_reason=c.stop_reason)


def _call_delta(d: CallDelta) -> ToolCallDelta:
    """The first piece of a call carries id, type and name (and arguments: "")."""
    if d.id is not None:
        return ToolCallDelta(index=d.index, id=d.id, type="function",
                             function=FunctionCallDelta(name=d.name, arguments=d.arguments))
    return ToolCallDelta(index=d.index, function=FunctionCallDelta(arguments=d.arguments))


def chat_logprobs(frontend: Frontend, entries: list[TokenLogprobs],
                  top_n: int | None) -> ChatLogprobs:
    """OpenAI chat logprobs: each chosen token with its `top_n` alternatives."""
    content = []
    for e in entries:
        tops = [_top(frontend, t, lp)
                for t, lp in zip(e.top_ids[:top_n or 0], e.top_logprobs, strict=False)]
        text = frontend.token_text(e.token_id)
        content.append(ChatTokenLogprob(token=text, logprob=e.logprob,
                                        bytes=list(text.encode()), top_logprobs=tops))
    return ChatLogprobs(content=content)


def _top(frontend: Frontend, token_id: int, logprob: float) -> TopLogprob:
    text = frontend.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
