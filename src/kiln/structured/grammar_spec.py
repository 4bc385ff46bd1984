"""What to compile: a request's structured-output params as one normalized, hashable spec.

`grammar_spec(params)` is the only place that reads `StructuredOutputsParams`; the compiler,
its cache and the gateway's validation all work on the `GrammarSpec` it returns. Cheap
checks happen here (size, JSON well-formedness, nesting depth), before anything compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kiln.sampling_params import StructuredOutputsParams

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SCHEMA_DEPTH = 64  # deeper JSON (schemas, structural tags) is refused before compiling
MAX_WHITESPACE = 16  # with disable_any_whitespace=False: most whitespace chars per JSON gap


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid, too large, or too expensive to compile.
    `code` is the OpenAI-style error code; the message says why."""

    def __init__(self, message: str, code: str = "invalid_grammar"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar to compile. Equal specs compile to the same grammar (the cache key)."""

    kind: str  # one of KINDS
    source: str  # schema / regex / EBNF / structural tag text ("" for json_object)
    any_whitespace: bool = False  # JSON kinds: allow (bounded) free whitespace

    @property
    def size(self) -> int:
        return len(self.source.encode("utf-8", "surrogatepass"))


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The spec for `params` (which SamplingParams already checked to set exactly one kind)."""
    ws = not params.disable_any_whitespace
    if params.json is not None:
        return GrammarSpec("json", str(params.json), ws)
    if params.json_object:
        return GrammarSpec("json_object", "", ws)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("choice", choice_ebnf(params.choice))
    if params.grammar is not None:
        return GrammarSpec("grammar", params.grammar)
    return GrammarSpec("structural_tag", str(params.structural_tag), ws)


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(spec: GrammarSpec, max_source_bytes: int) -> None:
    """Raise GrammarError for what must not reach the compiler: oversized or empty sources,
    JSON that does not parse, nesting deeper than MAX_SCHEMA_DEPTH."""
    if spec.size > max_source_bytes:
        raise GrammarError(f"the {spec.kind} is {spec.size} bytes; at most {max_source_bytes} "
                           "are accepted", code="grammar_too_large")
    if spec.kind in ("regex", "grammar") and not spec.source.strip():
        raise GrammarError(f"the {spec.kind} is empty")
    if spec.kind in ("json", "structural_tag"):
        check_json_text(spec.source, spec.kind)


def check_json_text(text: str, what: str) -> object:
    """Parse JSON text and bound its nesting; the parsed value (GrammarError if bad)."""
    depth = _bracket_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the {what} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
                           "are accepted", code="grammar_too_large")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"the {what} is not valid JSON: {exc}") from exc
    if what == "json" and not isinstance(value, (dict, bool)):
        raise GrammarError("a JSON schema must be an object (or a boolean)")
    return value


def _bracket_depth(text: str) -> int:
    """Deepest [ / { nesting outside strings (checked before json.loads, which recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def patch_schema(schema: object) -> object:
    """The schema with length-bounded plain strings as patterns (a copy; the input is kept).

    xgrammar (0.2.9) writes `{"type": "string", "maxLength": n}` as n characters of
    `[^"\\\r\n]`, which lets raw control characters (\x01, tabs) into the JSON text, and a
    strict parser rejects that. The same bounds as a pattern go through its JSON-string-aware
    regex path (only characters valid unescaped in JSON); the class excludes the surrogate
    range, which xgrammar would otherwise accept as UTF-8 (three bytes that decode to three
    U+FFFD, so the decoded string would be longer than maxLength).
    """
    if isinstance(schema, list):
        return [patch_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: patch_schema(v) for k, v in schema.items()}
    kinds = out.get("type")
    plain = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if (kinds == "string" or (isinstance(kinds, list) and "string" in kinds)) and plain and (
            "minLength" in out or "maxLength" in out):
        low, high = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(low, int) and (high == "" or isinstance(high, int)):
            out["pattern"] = f"^[^\\ud800-\\udfff]{{{low},{high}}}$"  # the bounds live here now
            out.pop("minLength", None)
            out.pop("maxLength", None)
    return out

