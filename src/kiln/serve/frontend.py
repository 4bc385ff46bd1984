"""Text <-> tokens in the gateway: the tokenizer, chat templates, and token text for logprobs.

Everything that can fail on user input raises `RequestError` (a 400 naming the field), never a
tokenizer or template traceback: lone surrogates, template errors, unknown token ids.
"""

from __future__ import annotations

import functools
import json

from kiln.engine.limits import RequestError
from kiln.serve.protocol import ChatMessage
from kiln.structured.tools import FORMATS, Tool, ToolFormat, inject_tools


class Frontend:
    """Owns the tokenizer. Token texts for logprobs are cached per id (the vocabulary is
    bounded), so the per-token work of a logprobs stream is a dict lookup."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._token_text: dict[int, str] = {}

    @classmethod
    def load(cls, path: str) -> Frontend:
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(path))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        _check_encodable(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.vocab_size})", param=param)
        return self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[Tool] | None = None, tool_format: ToolFormat | None = None,
                    ) -> list[int]:
        """Render the chat template and tokenize it (the template adds any special tokens).
        Tools go to the template; a template that ignores them gets them (and tool turns of
        the history) written into the messages in `tool_format` (kiln.structured.tools)."""
        if not self.has_chat_template:
            raise RequestError("this model has no chat template; use /v1/completions",
                               param="messages")
        conversation = [_as_template_message(m) for m in messages]
        for m in conversation:
            _check_encodable(m["content"], "messages")
        extra = {}
        if tools or any(m["role"] == "tool" or "tool_calls" in m for m in conversation):
            if self.renders_tools:
                extra["tools"] = [t.openai() for t in tools or []] or None
            else:
                conversation = inject_tools(conversation, tools or [],
                                            tool_format or FORMATS["hermes"])
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                **extra)
        except Exception as exc:  # jinja errors, template raise_exception(), type errors
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               param="messages") from exc
        return self.encode(text, add_special_tokens=False, param="messages")


    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model a `tools` list (probed once)."""
        probe = Tool("kiln_probe_tool_7f3a", None, {"type": "object"})
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[probe.openai()], tokenize=False,
                add_generation_prompt=True)
        except Exception:
            return False
        return probe.name in text


def _as_template_message(m: ChatMessage) -> dict:
    """The {"role", "content"} dict chat templates expect (text parts joined), with
    `tool_calls` (arguments as objects, as HF templates expect) and `tool_call_id`."""
    if isinstance(m.content, list):
        content = "\n".join(part.text for part in m.content)
    else:
        content = m.content or ""
    role = "system" if m.role == "developer" else m.role
    message = {"role": role, "content": content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(arguments: str | dict):
    """A call's arguments as an object when they are a JSON object's text, else as given."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _check_encodable(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode (a lone surrogate at position "
                           f"{exc.start})", param=param) from exc
