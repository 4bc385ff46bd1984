"""The OpenAI-compatible request and response schemas (pydantic), plus kiln's extensions.

Requests are validated here: ranges are part of the schema (so the OpenAPI document states
them; booleans must be JSON booleans, not 0/1 or "true"), and every violation becomes a 400
naming the field (`kiln.serve.errors`). Unknown fields are ignored, as OpenAI-compatible
servers commonly do. Caps that are server settings (`n`, `top_logprobs`) are checked by the
handlers, since a schema is fixed at import.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

INT64 = 2**63
StopString = Annotated[str, Field(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: StrictBool = False  # a last chunk with `usage` (and empty `choices`)


# -- structured output (kiln.structured) ----------------------------------------------------------

class JSONSchemaSpec(_Model):
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict | StrictBool | None = Field(None, alias="schema", description="the JSON schema")
    strict: StrictBool | None = None  # accepted; kiln always decodes strictly


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class StructuredOutputs(_Model):
    """kiln/vLLM extension: exactly one of json, regex, choice, grammar, json_object,
    structural_tag (see docs/structured.md)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    json_: dict | StrictBool | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="EBNF (xgrammar / GBNF), root rule `root`")
    json_object: StrictBool | None = None
    structural_tag: dict | str | None = Field(None, description="an xgrammar structural tag")
    disable_any_whitespace: StrictBool = Field(True, description="kiln default true: compact JSON")


class RepetitionGuard(_Model):
    """kiln extension: the repetition guard of this request (docs/structured.md)."""

    mode: Literal["off", "stop", "retry"] | None = None
    token_run: int = Field(4, ge=2, le=65536)
    filler_run: int = Field(128, ge=2, le=65536)
    ngram_period: int = Field(32, ge=0, le=256)
    ngram_copies: int = Field(16, ge=2, le=65536)


class SamplingRequest(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None = the served model
    n: int = Field(1, ge=1, description="choices per prompt (capped by the server's --max-n)")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31, description="kiln/vLLM; -1 or 0 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # recorded nowhere; accepted for compatibility
    ignore_eos: StrictBool = Field(False, description="kiln: keep generating past end-of-sequence")
    min_tokens: int = Field(0, ge=0, lt=2**31, description="kiln: no EOS/stop before this many")
    priority: int = Field(0, ge=-(2**31), lt=2**31,
                          description="kiln: lower runs first when the server uses --policy priority")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="kiln/vLLM: constrain the output to a JSON schema, regex, choice or grammar")
    repetition_guard: Literal["off", "stop", "retry"] | RepetitionGuard | None = Field(
        None, description="kiln: off | stop | retry, or settings; default: the server's")


# -- chat ----------------------------------------------------------------------------------------

class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Model):
    name: str
    arguments: str | dict = "{}"  # JSON text (OpenAI); an object is accepted too


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this answers


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # JSON schema of the arguments; None = any object
    strict: StrictBool | None = None  # accepted; forced calls always decode strictly


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[ToolDef], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # kiln/vLLM: the stop string or token id that matched


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class SpeculativeUsage(BaseModel):
    """kiln extension: speculative decoding of this request (all its choices together)."""

    draft_tokens: int  # drafts the target verified
    accepted_tokens: int  # of which it accepted
    verify_steps: int  # sequence-steps that verified drafts
    mean_accepted_length: float  # accepted drafts per verify step


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cost: float = Field(description="kiln: USD for this request, from the server's price table")
    speculative: SpeculativeUsage | None = Field(
        None, description="kiln: draft tokens proposed and accepted (absent without drafts)")
    guard_redraws: int | None = Field(
        None, description="kiln: tokens the repetition guard dropped and sampled again; in a "
        "constrained request its masked interventions (absent without any)")
    json_closing_steered: int | None = Field(
        None, description="kiln: tokens drawn narrowed so that a JSON-constrained response "
        "closes its JSON within max_tokens (the closing budget; absent without any)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- completions ---------------------------------------------------------------------------------

class CompletionRequest(SamplingRequest):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(16, ge=0, description="0 with echo: prompt logprobs only")
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported; must be absent")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set, except on streamed chunks before the last


# -- models, tokenizer, errors -----------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None  # either a prompt ...
    messages: list[ChatMessage] | None = None  # ... or chat messages (the template applies)
    add_special_tokens: StrictBool = True  # prompt only
    add_generation_prompt: StrictBool = True  # messages only


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
