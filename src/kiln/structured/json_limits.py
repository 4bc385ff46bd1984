"""Bounds on degenerate JSON inside a JSON-constrained request, enforced by masking.

A grammar guarantees the shape of the JSON, not that it ends: a number may grow digits forever,
a string may run on, an array may repeat one element until the length limit. `JsonShape`
follows the output text character by character (a small JSON lexer: strings, escapes, numbers,
array nesting) and, for the text a sampled token would add, names the first bound it would
break. The guard (kiln.structured.hooks) then drops that token and bans it, with the tokens
that would break the bound the same way, for a redraw of the same position; the grammar's other
legal continuations win (the number ends, the string goes on with other characters, the array
closes with `]`), so the output stays valid JSON. In a structural tag (tool calls) the shape
follows only the JSON values that come after a tag's begin (`JsonShape.tagged`): the
arguments of each call, not the free text or the tags around them.

Bounds (`JsonLimits`, docs/structured.md):
  number digits     at most 16 significant digits (float64 carries no more), at most 16 zeros
                    before the first significant one, at most 3 exponent digits. A schema whose
                    `minimum`/`maximum`/... need more digits raises the significant bound to fit.
  string runs       at most 32 of one character in a row, at most 32 digits in a row; a
                    string that fills its bound a third time must close (only `"` left).
  string loops      a string that ends in 4 copies of one chunk of 2..64 characters
                    (`-Ki-Ki-Ki-Ki`, `-10-2018-10-2018...`), 3 of a chunk of 16 or more,
                    must close.
  repeated elements the same array element written identically `element_copies` times in a
                    row (3: strings, objects, arrays; 8: numbers, true/false/null, since rows
                    of zeros are common), two alternating elements 3 times each, or 6
                    objects with a string member that differ only in their numbers and in the
                    counters ending their strings (a model counting `{"name":"Laptop",
                    "quantity":1}`, `..."quantity":2}` or `{"name":"Item1"}`, `{"name":
                    "Item2"}` up), ends the array: no further `,` in it.
  repeated members  an object's last 3 member values identical (8: numbers and literals) ends
                    the object the same way (a schema's required members overrule the ban).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from enum import Enum

NUMBER_START = "-0123456789"
NUMBER_CHARS = "0123456789.eE+-"
LONG_CHUNK = 16  # string chunks this long loop at one copy fewer
HISTORY = 8  # complete elements remembered per array (>= every *_copies, 2 x element_copies)
_NUMBER = re.compile(r'-?\d+(\.\d+)?([eE][+-]?\d+)?')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# digits ending a string right after a letter (and at most one separator): a label's counter,
# as a model counting items writes them; dates, times and ids of digits keep their digits
_COUNTER = re.compile(r'(?<=[^\W\d_])([ _#-]?)\d+(?="$)')


class Breach(Enum):
    """Which bound a token would break."""

    NUMBER_DIGITS = "number_digits"
    EXPONENT_DIGITS = "exponent_digits"
    STRING_RUN = "string_run"
    STRING_DIGITS = "string_digits"
    STRING_END = "string_end"  # a run past its bound again after two capped runs: close it
    STRING_LOOP = "string_loop"  # a string ends in 4 copies of one chunk: close it
    REPEATED_ELEMENT = "repeated_element"
    REPEATED_MEMBER = "repeated_member"

    @property
    def ends_container(self) -> bool:
        """The breach bans the comma: the array or object must end."""
        return self in (Breach.REPEATED_ELEMENT, Breach.REPEATED_MEMBER)

    def banned_starts(self, char: str) -> str:
        """The first characters of the tokens banned with the breaking one: those that
        would break the bound the same way (`char`: the character that broke it); "" for
        STRING_END and STRING_LOOP, which ban every token but those that close the string."""
        return {Breach.NUMBER_DIGITS: "0123456789.", Breach.EXPONENT_DIGITS: "0123456789",
                Breach.STRING_RUN: char, Breach.STRING_DIGITS: "0123456789",
                Breach.STRING_END: "", Breach.STRING_LOOP: "",
                Breach.REPEATED_ELEMENT: ",", Breach.REPEATED_MEMBER: ","}[self]


@dataclass(frozen=True)
class JsonLimits:
    number_digits: int = 16
    leading_zeros: int = 16
    exponent_digits: int = 3
    string_run: int = 32
    string_digits: int = 32
    string_loop_copies: int = 4  # a chunk of 2..64 characters this many times ends a string
    string_loop_chunk: int = 64
    element_copies: int = 3
    scalar_copies: int = 8
    similar_copies: int = 6  # objects equal but for their numbers (counting items up)


@dataclass
class _Level:
    """One open array or object: where its current element (an object's: member value)
    began, and the last complete ones' texts."""

    array: bool
    start: int | None = None  # offset in the text where the current element began
    recent: list[str] = field(default_factory=list)
    after_colon: bool = False  # an object's: a member's value comes next
    after_comma: bool = False  # an element (array) or a member (object) must come next
    keys: tuple[str, ...] = ()  # an object's member keys so far (the last: the current one)
    count: int = 0  # an array's elements begun

    def copy(self) -> _Level:
        return _Level(self.array, self.start, list(self.recent), self.after_colon,
                      self.after_comma, self.keys, self.count)


@dataclass
class _Number:
    significant: int = 0
    zeros: int = 0  # zeros before the first significant digit
    exponent: int | None = None  # digits after e/E; None before the exponent


@dataclass
class JsonShape:
    limits: JsonLimits = field(default_factory=JsonLimits)
    text: str = ""
    levels: list[_Level] = field(default_factory=list)  # the open arrays and objects
    in_string: bool = False
    escaped: bool = False
    run_char: str = ""
    run: int = 0
    digits: int = 0  # digits in a row inside the current string
    string_start: int = 0  # offset of the current string's first character
    capped: int = 0  # runs in the current string that reached their bound
    number: _Number | None = None
    at: int = 0  # offset in `text` of the character being read
    in_key: bool = False  # the current string is an object's member key
    version: int = 0  # counts the characters read outside string contents (kiln.structured.
    # closing caches its estimate per version: string characters never change it)
    # structural tags (tool calls): JSON values begin after one of `begins` and the text
    # between them (free text, the tags themselves) is not JSON; () when all of it is JSON
    begins: tuple[str, ...] = ()
    begin_ends: str = ""  # the begins' last characters (only they can complete one)
    outside: bool = False  # between tagged JSON values
    started: bool = False  # the current tagged value has begun
    shared_levels: bool = False  # `levels` (list and items) shared with a fork: copy first

    @classmethod
    def tagged(cls, limits: JsonLimits, begins: tuple[str, ...]) -> JsonShape:
        """A shape for output whose JSON values each follow one of `begins`."""
        return cls(limits, begins=begins, begin_ends="".join({b[-1] for b in begins if b}),
                   outside=True)

    def fork(self) -> JsonShape:
        """A copy to test a token on (once per sampled token, so cheap): the two share their
        open levels until either changes one (`_own_levels`), which most tokens never do."""
        twin = JsonShape.__new__(JsonShape)
        twin.__dict__.update(self.__dict__)  # every field; `text` is an immutable str
        self.shared_levels = twin.shared_levels = True
        n = self.number
        if n is not None:
            twin.number = _Number(n.significant, n.zeros, n.exponent)
        return twin

    def _own_levels(self) -> list[_Level]:
        """`levels`, copied first if a fork shares them (to change them)."""
        if self.shared_levels:
            self.levels = [level.copy() for level in self.levels]
            self.shared_levels = False
        return self.levels

    def feed(self, piece: str) -> tuple[Breach, str] | None:
        """Advance over `piece`; the first bound broken (with the character involved), or
        None. After a breach the state is unusable: feed a `fork()` to test a token."""
        first = len(self.text)
        self.text += piece
        for i, ch in enumerate(piece):
            if self.in_string and not self.escaped and ch != '"' and ch != "\\":
                breach = self._plain_string_char(ch)  # most characters: no offsets needed
            elif self.outside:
                if ch in self.begin_ends:
                    self.at = first + i
                    self.outside = not self._begins_here()
                continue
            else:
                self.at = first + i
                breach = self._char(ch)
                if breach is None and self.begins and self._value_ended():
                    self.outside = True
            if breach is not None:
                return breach, ch
        if self.in_string and self._string_loops():
            return Breach.STRING_LOOP, piece[-1:]
        return None

    def _begins_here(self) -> bool:
        """Outside: whether the text up to this character ends with a begin (a JSON value
        follows)."""
        end = self.at + 1
        if any(self.text.endswith(b, 0, end) for b in self.begins):
            self.started = False
            return True
        return False

    def _value_ended(self) -> bool:
        return self.started and not self.levels and not self.in_string and self.number is None

    def _string_loops(self) -> bool:
        """Whether the current string ends in `string_loop_copies` copies of one chunk of 2..64
        characters, or one copy fewer of a chunk of 16 or more (checked once per token: a few
        slice comparisons)."""
        lim, text, end = self.limits, self.text, len(self.text)
        length = end - self.string_start
        for size in range(2, min(lim.string_loop_chunk, length // 2) + 1):
            if text[end - 1] != text[end - 1 - size]:
                continue  # not periodic at the last character: the common, O(1) case
            span = size * (lim.string_loop_copies - (size >= LONG_CHUNK))
            if span <= length and text.startswith(text[end - span + size:], end - span) and \
                    len(set(text[end - span:end])) > 1:
                return True
        return False

    # -- one character ------------------------------------------------------------------------

    def _char(self, ch: str) -> Breach | None:
        self.version += 1
        if self.in_string:
            return self._string_char(ch)
        if self.number is not None:
            if ch in NUMBER_CHARS:
                return self._number_char(ch)
            self.number = None
        if ch == '"':
            top = self.levels[-1] if self.levels else None
            self.in_key = top is not None and not top.array and not top.after_colon
            if self.in_key and top.after_comma:
                self._own_levels()[-1].after_comma = False
            self._value_starts()
            self.in_string, self.run, self.digits, self.capped = True, 0, 0, 0
            self.string_start = self.at + 1
        elif ch in NUMBER_START:
            self._value_starts()
            self.number = _Number()
            return self._number_char(ch)
        elif ch in "[{":
            self._value_starts()
            self._own_levels().append(_Level(array=ch == "["))
        elif ch in "]}":
            if self.levels:  # a closed level is dropped: the others may stay shared
                self.levels = self.levels[:-1]
        elif ch == ",":
            return self._comma()
        elif ch == ":":
            if self.levels:
                self._own_levels()[-1].after_colon = True
        elif ch in "tfn":
            self._value_starts()
        return None

    def _string_char(self, ch: str) -> Breach | None:
        if self.escaped:
            self.escaped, self.run, self.digits = False, 0, 0
            return None
        if ch == "\\":
            self.escaped = True
            return None
        if ch == '"':
            self.in_string = False
            if self.in_key and self.levels:  # `levels` is empty only in a bare key (a bug)
                top = self._own_levels()[-1]
                top.keys += (self.text[self.string_start:self.at],)
                self.in_key = False
            return None
        return self._plain_string_char(ch)

    def _plain_string_char(self, ch: str) -> Breach | None:
        """A character of a string's content (not an escape or its closing quote)."""
        self.run = self.run + 1 if ch == self.run_char else 1
        self.run_char = ch
        self.digits = self.digits + 1 if ch.isdigit() else 0
        lim = self.limits
        self.capped += self.run == lim.string_run or self.digits == lim.string_digits
        if self.run > lim.string_run or self.digits > lim.string_digits:
            if self.capped > 2:  # the third capped run: the string goes nowhere, end it
                return Breach.STRING_END
            return Breach.STRING_RUN if self.run > lim.string_run else Breach.STRING_DIGITS
        return None

    def _number_char(self, ch: str) -> Breach | None:
        n, lim = self.number, self.limits
        if ch in "eE":
            n.exponent = 0
        elif not ch.isdigit():
            return None  # sign or decimal point
        elif n.exponent is not None:
            n.exponent += 1
            return Breach.EXPONENT_DIGITS if n.exponent > lim.exponent_digits else None
        elif ch == "0" and not n.significant:
            n.zeros += 1
            return Breach.NUMBER_DIGITS if n.zeros > lim.leading_zeros else None
        else:
            n.significant += 1
            return Breach.NUMBER_DIGITS if n.significant > lim.number_digits else None
        return None

    # -- array elements and member values ------------------------------------------------------

    def _value_starts(self) -> None:
        """A value begins here: if it is an array element or a member's value, remember
        where (the first character only: `"` of a string inside an element object is not
        an element; an object's key is not a value)."""
        self.started = True
        top = self.levels[-1] if self.levels else None
        if top is not None and top.start is None and (top.array or top.after_colon):
            top = self._own_levels()[-1]
            top.start = self.at
            top.after_colon = top.after_comma = False
            top.count += top.array

    def _comma(self) -> Breach | None:
        if not self.levels:
            return None
        top = self._own_levels()[-1]
        self._complete(top)
        top.after_comma = True
        if top.array:
            return Breach.REPEATED_ELEMENT if self._elements_loop(top.recent) else None
        return Breach.REPEATED_MEMBER if self._same_loop(top.recent) else None

    def _same_loop(self, recent: list[str]) -> bool:
        """The last values are one value `element_copies` times (scalars: `scalar_copies`)."""
        if not recent:
            return False
        lim = self.limits
        same = lim.element_copies if recent[-1][:1] in '"[{' else lim.scalar_copies
        return len(recent) >= same and len(set(recent[-same:])) == 1

    def _elements_loop(self, recent: list[str]) -> bool:
        """The last elements are one element `element_copies` times (scalars:
        `scalar_copies`), or two alternating elements `element_copies` times each."""
        if not recent or self._same_loop(recent):
            return bool(recent)
        lim = self.limits
        if recent[-1][:1] not in '"[{':
            return False
        pair = recent[-2 * lim.element_copies:]
        if len(pair) == 2 * lim.element_copies and pair == pair[:2] * lim.element_copies:
            return True
        similar = recent[-lim.similar_copies:]
        return len(similar) == lim.similar_copies and recent[-1][:1] == "{" and \
            len({_numbers_blanked(e) for e in similar}) == 1 and '":"' in _squeeze(recent[-1])

    def _complete(self, level: _Level) -> None:
        if level.start is None:
            return
        level.recent = (level.recent + [self.text[level.start:self.at].strip()])[-HISTORY:]
        level.start = None


@functools.lru_cache(maxsize=256)  # per request, and requests often share a schema
def limits_for_schema(schema_text: str | None) -> JsonLimits:
    """The default limits, with the significant-digit bound raised to fit the largest
    numeric bound the schema names (so `maximum: 1e20` integers stay writable)."""
    if not schema_text:
        return JsonLimits()
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return JsonLimits()
    needed = max((_digits(v) for v in _numeric_bounds(schema)), default=0)
    return JsonLimits(number_digits=max(JsonLimits.number_digits, needed))


@functools.lru_cache(maxsize=256)
def tag_json_begins(tag_text: str) -> tuple[str, ...] | None:
    """For an xgrammar structural tag (JSON text): the texts after which its JSON content
    begins (the tags' `begin`s whose content is a JSON schema; tool calls: `<tool_call>\\n
    {"name": "f", "arguments": `); () when the whole output is one JSON value; None when no
    JSON content can be followed (free-form content, or text that is not a tag)."""
    try:
        tag = json.loads(tag_text)
    except ValueError:
        return None
    fmt = tag.get("format") if isinstance(tag, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return ()
    begins = tuple(dict.fromkeys(_json_begins(tag)))
    return begins or None


def _json_begins(node: object):
    if isinstance(node, list):
        for item in node:
            yield from _json_begins(item)
    elif isinstance(node, dict):
        content = node.get("content")
        begin = node.get("begin")
        if isinstance(begin, str) and begin and (
                "schema" in node or isinstance(content, dict) and
                content.get("type") == "json_schema"):
            yield begin  # {"type": "tag", "content": {"type": "json_schema"}}, or the
            return       # older {"begin", "schema", "end"} structures
        for value in node.values():
            yield from _json_begins(value)


_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _numeric_bounds(schema: object):
    if isinstance(schema, list):
        for item in schema:
            yield from _numeric_bounds(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key in _BOUND_KEYS and isinstance(value, (int, float)) and \
                    not isinstance(value, bool):
                yield value
            else:
                yield from _numeric_bounds(value)


def _digits(value: int | float) -> int:
    """Significant digits needed to write numbers up to |value| (plus one of headroom)."""
    if isinstance(value, int):
        return len(str(abs(value))) + 1
    if not math.isfinite(value) or value == 0:
        return 0
    return max(0, math.floor(math.log10(abs(value)))) + 2


def _numbers_blanked(element: str) -> str:
    """The element with every JSON number outside its strings, and every counter ending a
    string (`"Item1"`, `"Song 12"`), written as `#`."""
    parts, at = [], 0
    for m in _STRING.finditer(element):
        parts.append(_NUMBER.sub("#", element[at:m.start()]) +
                     _COUNTER.sub(r"\1#", m.group()))
        at = m.end()
    return "".join(parts) + _NUMBER.sub("#", element[at:])


def _squeeze(element: str) -> str:
    return re.sub(r'"\s*:\s*"', '":"', element)
