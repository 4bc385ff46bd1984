"""Tool calls out of model text: whole (`parse_tool_calls`) or as it streams (`ToolCallStream`).

Both read a call's arguments as the raw JSON text the model wrote (never re-serialized), so
the `arguments` deltas of a stream concatenate to exactly the non-streamed `arguments`, and the
content outside calls is the same (up to surrounding whitespace). A call whose body is not a
JSON object with a string `name` is left as content (non-streamed); grammars make that
impossible for constrained tool choices.

hermes streams incrementally: content until `<tool_call>` (a partial tag is held back), then
the call's id and name as soon as the name is complete, then its arguments as they grow. json
(bare objects) decides on the first non-blank character: `{` or `[` buffers the output and
emits its calls when it ends; anything else is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kiln.structured.tools import ToolFormat


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]


@dataclass
class CallDelta:
    """A streamed piece of call `index`: the first carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- one JSON object, scanned as it grows -------------------------------------------------------

class ObjectScanner:
    """Walks the text of one JSON object as it arrives and records, for each top-level member,
    where its value starts and (once known) ends: `members[key] = [start, end or None]`."""

    def __init__(self):
        self.text = ""
        self.members: dict[str, list] = {}
        self.done = False  # the object's closing brace was seen
        self._i = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_start = 0
        self._key: str | None = None  # the key whose value comes next / is being read
        self._value_key: str | None = None  # member whose value is open at depth 1
        self._after_colon = False

    def feed(self, text: str) -> None:
        self.text += text
        while self._i < len(self.text) and not self.done:
            self._step(self.text[self._i])
            self._i += 1

    def _step(self, ch: str) -> None:
        if self._in_string:
            self._string_char(ch)
        elif ch == '"':
            self._in_string, self._string_start = True, self._i
            self._start_value()
        elif ch in "{[":
            self._start_value()
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value(self._i + 1)
            elif self._depth == 0:
                self._end_value(self._i, scalar=True)
                self.done = True
        elif self._depth == 1 and ch == ":":
            self._after_colon = True
        elif self._depth == 1 and ch == ",":
            self._end_value(self._i, scalar=True)
        elif not ch.isspace():
            self._start_value()

    def _string_char(self, ch: str) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            if self._depth == 1 and self._value_key is None and not self._after_colon:
                self._key = json.loads(self.text[self._string_start:self._i + 1])
            elif self._depth == 1:
                self._end_value(self._i + 1)

    def _start_value(self) -> None:
        if self._depth == 1 and self._after_colon and self._key is not None:
            self.members[self._key] = [self._i, None]
            self._value_key, self._after_colon = self._key, False

    def _end_value(self, end: int, scalar: bool = False) -> None:
        key = self._value_key
        if key is None or self.members[key][1] is not None:
            return
        if scalar:  # a number or literal ends at the delimiter, minus trailing blanks
            end = len(self.text[:end].rstrip())
        self.members[key][1] = end
        self._value_key = self._key = None

    def value(self, key: str) -> str | None:
        """The raw text of a member's value so far (complete once `complete(key)`)."""
        span = self.members.get(key)
        if span is None:
            return None
        return self.text[span[0]:span[1] if span[1] is not None else len(self.text)]

    def complete(self, key: str) -> bool:
        span = self.members.get(key)
        return span is not None and span[1] is not None


def _args_key(scanner: ObjectScanner) -> str | None:
    for key in ("arguments", "parameters"):
        if key in scanner.members:
            return key
    return None


def call_from_text(body: str) -> ToolCall | None:
    """A call from one JSON object's text, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    scanner = ObjectScanner()
    scanner.feed(body.strip())
    key = _args_key(scanner)
    return ToolCall(new_call_id(), obj["name"], scanner.value(key) if key else "{}")


# -- whole outputs ------------------------------------------------------------------------------

def parse_tool_calls(text: str, fmt: ToolFormat) -> ParsedOutput:
    if fmt.open_tag:
        return _parse_tagged(text, fmt)
    return _parse_bare(text)


def _parse_tagged(text: str, fmt: ToolFormat) -> ParsedOutput:
    calls, content, at = [], [], 0
    while (start := text.find(fmt.open_tag, at)) >= 0:
        end = text.find(fmt.close_tag, start)
        body_end = end if end >= 0 else len(text)
        call = call_from_text(text[start + len(fmt.open_tag):body_end])
        if call is None:
            break  # not a call: the rest stays content
        content.append(text[at:start].rstrip())  # blanks before a call are not content
        calls.append(call)
        at = body_end + len(fmt.close_tag) if end >= 0 else len(text)
    content.append(text[at:])
    return ParsedOutput("".join(content).strip() or None, calls)


def _parse_bare(text: str) -> ParsedOutput:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return ParsedOutput(stripped or None, [])
    calls = _bare_calls(stripped)
    return ParsedOutput(None, calls) if calls else ParsedOutput(stripped, [])


def _bare_calls(text: str) -> list[ToolCall]:
    """Calls from a JSON object, a JSON array of them, or objects one after another."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, list):
        found = [call_from_text(json.dumps(v, ensure_ascii=False)) for v in value]
        return found if found and all(found) else []
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return []
        call = call_from_text(text[at:end])
        if call is None:
            return []
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
    return calls


# -- streams ---------------------------------------------------------------------------------------

class ToolCallStream:
    """Feed a sequence's text deltas; get content and call deltas (OpenAI's streaming shape)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.num_calls = 0
        self._buffer = ""  # text not yet given out
        self._call: _StreamedCall | None = None
        self._bare: bool | None = None  # json format: is the output a call (decided once)
        self._started = False  # any content given out (leading blanks are dropped)
        self._blank_tail = ""  # blanks held until more content follows them

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        if not self.fmt.open_tag:
            return self._feed_bare()
        out = StreamDelta()
        while self._buffer:
            if self._call is None and not self._content_until_tag(out):
                break
            if self._call is not None and not self._call_until_close(out):
                break
        return out

    def finish(self) -> StreamDelta:
        """Flush at the end of the sequence (a call cut off stays as far as it got)."""
        out = StreamDelta()
        if not self.fmt.open_tag:
            if self._bare:
                return self._bare_calls_out()
            return StreamDelta(self._content(self._buffer, final=True))
        if self._call is not None:
            self._call.feed(self._buffer, out)
        else:
            out.content += self._content(self._buffer, final=True)
        self._buffer = ""
        return out

    # -- hermes ---------------------------------------------------------------------------

    def _content_until_tag(self, out: StreamDelta) -> bool:
        tag = self.fmt.open_tag
        start = self._buffer.find(tag)
        if start < 0:
            keep = _partial_suffix(self._buffer, tag)
            out.content += self._content(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        out.content += self._content(self._buffer[:start])
        self._blank_tail = ""  # blanks before a call are not content
        self._buffer = self._buffer[start + len(tag):]
        self._call = _StreamedCall(self.num_calls)
        self.num_calls += 1
        return True

    def _call_until_close(self, out: StreamDelta) -> bool:
        tag = self.fmt.close_tag
        end = self._buffer.find(tag)
        if end < 0:
            keep = _partial_suffix(self._buffer, tag)
            self._call.feed(self._buffer[:len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._call.feed(self._buffer[:end], out)
        self._buffer = self._buffer[end + len(tag):]
        self._call = None
        return True

    def _content(self, text: str, final: bool = False) -> str:
        """Content to give out now: without leading blanks, and holding trailing blanks
        until content follows (so blanks around calls never reach the client)."""
        text = self._blank_tail + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._blank_tail = "" if final else text[len(body):]
        self._started = self._started or bool(body)
        return body

    # -- json -------------------------------------------------------------------------------

    def _feed_bare(self) -> StreamDelta:
        if self._bare is None:
            head = self._buffer.lstrip()
            if not head:
                return StreamDelta()
            self._bare = head[0] in "{["
        if self._bare:
            return StreamDelta()  # calls come whole at the end
        out = StreamDelta(self._content(self._buffer))
        self._buffer = ""
        return out

    def _bare_calls_out(self) -> StreamDelta:
        parsed = _parse_bare(self._buffer)
        self._buffer = ""
        if not parsed.calls:
            return StreamDelta(parsed.content or "")
        calls = [CallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(parsed.calls)]
        self.num_calls = len(calls)
        return StreamDelta(calls=calls)


class _StreamedCall:
    """One hermes call being streamed: id and name once the name is complete, then the
    arguments text as it grows."""

    def __init__(self, index: int):
        self.index = index
        self.scanner = ObjectScanner()
        self.named = False
        self.sent = 0  # characters of the arguments given out

    def feed(self, text: str, out: StreamDelta) -> None:
        self.scanner.feed(text)
        if not self.named:
            if not self.scanner.complete("name"):
                return
            try:
                name = json.loads(self.scanner.value("name"))
            except ValueError:
                return
            if not isinstance(name, str):
                return
            out.calls.append(CallDelta(self.index, new_call_id(), name))
            self.named = True
        key = _args_key(self.scanner)
        if key is None:
            return
        args = self.scanner.value(key)
        if len(args) > self.sent:
            out.calls.append(CallDelta(self.index, arguments=args[self.sent:]))
            self.sent = len(args)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
