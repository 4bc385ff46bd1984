"""The gateway's share of structured output: requests in, StructuredOutputsParams out, and every
grammar compiled once before admission so a bad one is a 400 with its reason.

Validation builds the grammar with the gateway's tokenizer (lazy masks: no token-mask
precompute) through its own bounded cache and under the workers' time limit
(`StructuredConfig`), on a thread, so the event loop never waits on it; a cached grammar
validates in microseconds. Workers compile again with precomputed masks, in the background
while the prompt prefills (falling back to lazy masks past the time limit), so a grammar
that passed here is usable there.

`plan_tools` turns `tools` / `tool_choice` / `parallel_tool_calls` into a `ToolPlan`: the call
format, the tools for the chat template, and the grammar for required / named / auto choices.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.config import StructuredConfig
from kiln.engine.limits import RequestError
from kiln.sampling_params import StructuredOutputsParams
from kiln.structured.compiler import GrammarCompiler
from kiln.structured.grammar_spec import GrammarError, GrammarSpec, check_json_text, grammar_spec
from kiln.structured.tools import (
    NAME_RE,
    NO_PARAMETERS,
    Tool,
    ToolFormat,
    call_grammar,
    choose_format,
)
from kiln.structured.vocab import tokenizer_info


class GatewayStructured:
    def __init__(self, config: StructuredConfig, tokenizer,
                 on_compile: Callable[[GrammarSpec, float], None] | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.on_compile = on_compile
        self._compilers: dict[int, GrammarCompiler] = {}  # by the workers' vocab size

    def compiler(self, vocab_size: int) -> GrammarCompiler:
        if vocab_size not in self._compilers:
            self._compilers[vocab_size] = GrammarCompiler(
                lambda: tokenizer_info(self.tokenizer, vocab_size), self.config,
                lazy_masks=True)  # a check needs the grammar, not its token masks
        return self._compilers[vocab_size]

    async def validate(self, params: StructuredOutputsParams, vocab_size: int,
                       param: str) -> None:
        """Compile `params`' grammar (at most the time limit); RequestError naming `param`."""
        compiler = self.compiler(vocab_size)
        spec = grammar_spec(params)
        misses = compiler.stats.misses
        started = time.perf_counter()
        compilation = compiler.submit(spec)
        try:
            await compilation.wait_async()
        except GrammarError as exc:
            raise RequestError(str(exc), param=param, code=exc.code) from exc
        if compiler.stats.misses > misses and self.on_compile is not None:
            self.on_compile(spec, time.perf_counter() - started)


# -- response_format -> structured_outputs -----------------------------------------------------

def from_response_format(kind: str, schema: object | None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: text (nothing), json_object, json_schema (its `schema`;
    a missing schema means any JSON object)."""
    if kind == "json_object" or (kind == "json_schema" and schema is None):
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        return StructuredOutputsParams(json=_schema_text(schema))
    return None


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        check_json_text(schema, "json")
        return schema
    return json.dumps(schema, ensure_ascii=False)


# -- tools ------------------------------------------------------------------------------------

@dataclass
class ToolPlan:
    """How one chat request uses tools."""

    tools: list[Tool]
    fmt: ToolFormat
    choice: str  # none | auto | required | the forced tool's name
    parallel: bool = True
    grammar: str | None = field(default=None)  # structural tag JSON, when constrained

    @property
    def parses(self) -> bool:
        """Whether outputs are parsed for tool calls."""
        return self.choice != "none"

    @property
    def template_tools(self) -> list[Tool]:
        """The tools the prompt shows the model (none for tool_choice=none)."""
        return self.tools if self.parses else []


def plan_tools(tools: list[Tool], choice: str | None, parallel: bool, parser: str,
               chat_template: str | None) -> ToolPlan | None:
    """The plan for a request's tools (None without tools); RequestError for a bad choice."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique", param="tools")
    choice = choice or "auto"
    if choice not in ("none", "auto", "required") and choice not in names:
        raise RequestError(f"tool_choice names the function {choice!r}, which is not among "
                           "the tools", param="tool_choice")
    plan = ToolPlan(tools, choose_format(parser, chat_template), choice, parallel)
    if choice != "none":
        plan.grammar = call_grammar(tools, plan.fmt, choice, parallel)
    return plan


def make_tool(name: str, description: str | None, parameters: dict | None) -> Tool:
    """A Tool from a request's function definition (RequestError if unusable)."""
    if not NAME_RE.match(name):
        raise RequestError(f"tool name {name!r} must be 1-64 letters, digits, _ or -",
                           param="tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError("a tool's parameters must be a JSON schema object", param="tools")
    return Tool(name, description, parameters or dict(NO_PARAMETERS))
