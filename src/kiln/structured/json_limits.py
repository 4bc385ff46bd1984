"""Bounds on degenerate JSON inside a JSON-constrained request, enforced by masking.

A grammar guarantees the shape of the JSON, not that it ends: a number may grow digits forever,
a string may run on, an array may repeat one element until the length limit. `JsonShape`
follows the output text character by character (a small JSON lexer: strings, escapes, numbers,
array nesting) and, for the text a sampled token would add, names the first bound it would
break. The guard (kiln.structured.hooks) then drops that token and bans it, with the tokens
that would break the bound the same way, for a redraw of the same position; the grammar's other
legal continuations win (the number ends, the string goes on with other characters, the array
closes with `]`), so the output stays valid JSON.

Bounds (`JsonLimits`, docs/structured.md):
  number digits     at most 16 significant digits (float64 carries no more), at most 16 zeros
                    before the first significant one, at most 3 exponent digits. A schema whose
                    `minimum`/`maximum`/... need more digits raises the significant bound to fit.
  string runs       at most 32 of one character in a row, at most 32 digits in a row; a
                    string that fills its bound a third time must close (only `"` left).
  repeated elements the same array element written identically `element_copies` times in a
                    row (3: strings, objects, arrays; 8: numbers, true/false/null, since rows
                    of zeros are common) ends the array: no further `,` in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from enum import Enum

NUMBER_START = "-0123456789"
NUMBER_CHARS = "0123456789.eE+-"


class Breach(Enum):
    """Which bound a token would break."""

    NUMBER_DIGITS = "number_digits"
    EXPONENT_DIGITS = "exponent_digits"
    STRING_RUN = "string_run"
    STRING_DIGITS = "string_digits"
    STRING_END = "string_end"  # a run past its bound again after two capped runs: close it
    REPEATED_ELEMENT = "repeated_element"

    def banned_starts(self, char: str) -> str:
        """The first characters of the tokens banned with the breaking one: those that
        would break the bound the same way (`char`: the character that broke it); "" for
        STRING_END, which bans every token but those that close the string."""
        return {Breach.NUMBER_DIGITS: "0123456789.", Breach.EXPONENT_DIGITS: "0123456789",
                Breach.STRING_RUN: char, Breach.STRING_DIGITS: "0123456789",
                Breach.STRING_END: "", Breach.REPEATED_ELEMENT: ","}[self]


@dataclass(frozen=True)
class JsonLimits:
    number_digits: int = 16
    leading_zeros: int = 16
    exponent_digits: int = 3
    string_run: int = 32
    string_digits: int = 32
    element_copies: int = 3
    scalar_copies: int = 8


@dataclass
class _Array:
    start: int | None = None  # offset in the text where the current element began
    last: str | None = None  # the previous complete element's text
    copies: int = 0  # how many times in a row `last` was written


@dataclass
class _Number:
    significant: int = 0
    zeros: int = 0  # zeros before the first significant digit
    exponent: int | None = None  # digits after e/E; None before the exponent


@dataclass
class JsonShape:
    limits: JsonLimits = field(default_factory=JsonLimits)
    text: str = ""
    arrays: list[_Array | None] = field(default_factory=list)  # None for an object level
    in_string: bool = False
    escaped: bool = False
    run_char: str = ""
    run: int = 0
    digits: int = 0  # digits in a row inside the current string
    capped: int = 0  # runs in the current string that reached their bound
    number: _Number | None = None

    def fork(self) -> JsonShape:
        return replace(self, arrays=[replace(a) if a else None for a in self.arrays],
                       number=replace(self.number) if self.number else None)

    def feed(self, piece: str) -> tuple[Breach, str] | None:
        """Advance over `piece`; the first bound broken (with the character involved), or
        None. After a breach the state is unusable: feed a `fork()` to test a token."""
        for ch in piece:
            breach = self._char(ch)
            self.text += ch
            if breach is not None:
                return breach, ch
        return None

    # -- one character ------------------------------------------------------------------------

    def _char(self, ch: str) -> Breach | None:
        if self.in_string:
            return self._string_char(ch)
        if self.number is not None:
            if ch in NUMBER_CHARS:
                return self._number_char(ch)
            self.number = None
        if ch == '"':
            self._value_starts()
            self.in_string, self.run, self.digits, self.capped = True, 0, 0, 0
        elif ch in NUMBER_START:
            self._value_starts()
            self.number = _Number()
            return self._number_char(ch)
        elif ch in "[{":
            self._value_starts()
            self.arrays.append(_Array() if ch == "[" else None)
        elif ch in "]}":
            if self.arrays:
                self._element_ends(self.arrays.pop())
        elif ch == ",":
            return self._comma()
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
            return None
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

    # -- array elements -----------------------------------------------------------------------

    def _value_starts(self) -> None:
        """A value begins here: if it is an array element, remember where (the first
        character only: `"` of a string inside an element object is not an element)."""
        top = self.arrays[-1] if self.arrays else None
        if top is not None and top.start is None:
            top.start = len(self.text)

    def _element_ends(self, closed: _Array | None) -> None:
        """`]` or `}` closed a container; if it closed an array, its element ends too."""
        if closed is not None:
            self._complete(closed)

    def _comma(self) -> Breach | None:
        top = self.arrays[-1] if self.arrays else None
        if top is None:
            return None
        self._complete(top)
        copies = self.limits.element_copies if top.last and top.last[0] in '"[{' else \
            self.limits.scalar_copies
        return Breach.REPEATED_ELEMENT if top.copies >= copies else None

    def _complete(self, array: _Array) -> None:
        if array.start is None:
            return
        element = self.text[array.start:].strip()
        array.copies = array.copies + 1 if element == array.last else 1
        array.last, array.start = element, None


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
