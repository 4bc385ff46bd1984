"""Tool calling, model side: the call syntax of each format, the prompt that teaches it to a
model whose chat template ignores tools, and the grammar that forces valid calls.

Formats (`--tool-call-parser`, or chosen from the chat template by `choose_format`):
  hermes  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen 2.5/3,
          and the default when the template knows nothing of tools)
  json    a bare `{"name": ..., "parameters": {...}}` object (Llama 3.x style)

Grammars are xgrammar structural tags (JSON text, compiled like any other grammar):
  required  one or more calls (one with parallel_tool_calls=false), each naming a tool and
            carrying arguments valid against that tool's parameter schema
  named     exactly one call of that tool
  auto      hermes only: free text, but once the model writes `<tool_call>` the call must be
            valid (so auto calls parse too); json-style auto is not constrained
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kiln.structured.grammar_spec import patch_schema

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
# a function without `parameters` takes none (OpenAI: "an empty parameter list")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # the JSON schema of the arguments object

    def openai(self) -> dict:
        """The tool as OpenAI's `{"type": "function", "function": {...}}` dict."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn = {"name": self.name, "description": self.description,
                  "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # "arguments" or "parameters"
    open_tag: str  # "" when calls are bare JSON
    close_tag: str

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (`arguments` is JSON text)."""
        body = f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'
        return f"{self.open_tag}\n{body}\n{self.close_tag}" if self.open_tag else body

    def call_begin(self, name: str) -> str:
        begin = f'{{"name": {json.dumps(name)}, "{self.args_key}": '
        return f"{self.open_tag}\n{begin}" if self.open_tag else begin

    @property
    def call_end(self) -> str:
        return f"}}\n{self.close_tag}" if self.open_tag else "}"


FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>", "</tool_call>"),
    "json": ToolFormat("json", "parameters", "", ""),
}


def choose_format(parser: str, chat_template: str | None) -> ToolFormat:
    """`parser` (hermes | json), or with "auto": hermes if the template writes `<tool_call>`,
    json if it renders tools some other way, else hermes (the prompt then teaches it)."""
    if parser != "auto":
        if parser not in FORMATS:
            raise ValueError(f"unknown tool-call parser {parser!r}; choose from "
                             f"auto, {', '.join(FORMATS)}")
        return FORMATS[parser]
    template = chat_template or ""
    if "<tool_call>" in template or "tools" not in template:
        return FORMATS["hermes"]
    return FORMATS["json"]


# -- prompts ----------------------------------------------------------------------------------

def tool_prompt(tools: list[Tool], fmt: ToolFormat) -> str:
    """A system-prompt section describing the tools and the call syntax (Hermes/Qwen wording)
    for chat templates that do not render tools themselves."""
    listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    if fmt.open_tag:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
                f"\n<tools>\n{listing}\n</tools>\n\nFor each function call, return a json object "
                "with function name and arguments within <tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
                "</tool_call>")
    return ("You have access to the following functions. To call a function, respond with only "
            'a JSON object of the form {"name": function name, "parameters": dictionary of '
            f"argument name and its value}}.\n\n{listing}")


def inject_tools(conversation: list[dict], tools: list[Tool], fmt: ToolFormat) -> list[dict]:
    """The conversation with the tool prompt added to (or as) the system message, and tool
    calls / tool results written as text, for a template that knows nothing of tools."""
    out = [_as_text_message(m, fmt) for m in conversation]
    if tools:
        prompt = tool_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_text_message(m: dict, fmt: ToolFormat) -> dict:
    if m["role"] == "tool":
        if fmt.open_tag:
            return {"role": "user",
                    "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        return {"role": "user", "content": f"Function result: {m['content']}"}
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or not calls:
        return {"role": m["role"], "content": m.get("content") or ""}
    texts = [fmt.call_text(c["function"]["name"], _json_text(c["function"]["arguments"]))
             for c in calls]
    content = "\n".join(filter(None, [m.get("content") or "", *texts]))
    return {"role": "assistant", "content": content}


def _json_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                  ensure_ascii=False)


# -- grammars ---------------------------------------------------------------------------------

def call_grammar(tools: list[Tool], fmt: ToolFormat, choice: str,
                 parallel: bool = True) -> str | None:
    """The structural tag (JSON text) constraining output for a tool choice: "required",
    "auto", or a tool's name (forced). None when the choice needs no grammar."""
    def tag(tool: Tool) -> dict:
        return {"type": "tag", "begin": fmt.call_begin(tool.name),
                "content": {"type": "json_schema", "json_schema": patch_schema(tool.parameters),
                            "max_whitespace_cnt": 1},  # `{"a": 1}`, never runaway whitespace
                "end": fmt.call_end}

    if choice == "auto":
        if not fmt.open_tag:
            return None
        body = {"type": "triggered_tags", "triggers": [fmt.open_tag],
                "tags": [tag(t) for t in tools], "stop_after_first": not parallel}
    elif choice == "required":
        body = {"type": "tags_with_separator", "tags": [tag(t) for t in tools],
                "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}
    else:
        named = [t for t in tools if t.name == choice]
        body = tag(named[0])
    return json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False)
