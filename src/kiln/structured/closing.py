"""The closing budget: a JSON-constrained response that nears max_tokens still ends valid.

A grammar guarantees the shape of what a model writes, not that it ends within the token
budget: a sampled model may write a long, ever-varying string or list item after list item
until max_tokens cuts the JSON (the failures of benchmarks/structured_parse.py at temperature
0.7 were all of this kind). vLLM and xgrammar do nothing about it: at max_tokens the output
stops, unterminated, with finish_reason "length".

Kiln keeps a reserve. After every token of a JSON-constrained request with a `max_tokens`, the
hooks (kiln.structured.hooks) ask `tokens_to_close` what the shortest way to finish the JSON
from here costs: `ClosingPlan.closing_text` closes the open string (after what an enum,
minLength or format still owes), writes each required member not yet written with its
shortest value (`""`, `0`, the shortest enum value, `[]` unless minItems, nested required
members) and closes every open array and object; its UTF-8 bytes plus one (end-of-sequence)
bound the tokens (every token is at least a byte; under a grammar the default model often
spells a forced key one or two characters per token, more than a tokenizer's count). With
`need` that bound, `margin(need)` = need // 8 + 2 and `jump` the most one free token can add
(a new element or optional member at its shortest, per schema), the next draw is:

  free            while more than need + margin + jump tokens are left;
  open nothing    within `jump` of the reserve: no comma (in a string: no token that closes
  new             it and adds one), closers right after `[` or `{`; strings and numbers go on;
  close now       at the reserve: in a string the tokens that close it (`"`, `"}`, `":`),
                  elsewhere closers (`]`, `}`, end-of-sequence), else a comma (a required
                  member or minItems element must follow), else what the grammar allows.

Each narrowing is a list of token classes (`SteerMasks`), the first that leaves a token the
grammar allows winning, so the grammar's own requirements always overrule it. The estimate is
computed from the schema, not searched with the grammar, so it is cheap (cached per
structural state of the output: string characters never change it). Unconstrained requests
and other grammar kinds (regex, EBNF, tool calls' structural tags) are untouched; see
docs/structured.md "The closing budget" and docs/decisions/0014.
"""

from __future__ import annotations

import functools
import json

import torch

from kiln.structured.json_limits import JsonShape

MAX_DEPTH = 12  # schema nesting followed; deeper (recursive) schemas count as one token
FORMAT_LENGTHS = {"date": 10, "time": 8, "date-time": 20, "uuid": 36, "email": 5, "uri": 8,
                  "ipv4": 7, "ipv6": 3, "hostname": 1, "duration": 3}
UNKNOWN_STRING = 8  # characters assumed for a string whose pattern the estimate cannot read
FREE_KEY = 16  # bytes assumed for a key that the schema does not name


def margin(tokens: int) -> int:
    """Tokens kept on top of the estimate (see the module docstring)."""
    return tokens // 8 + 2


def tokens_to_close(plan: ClosingPlan, shape: JsonShape) -> int:
    """An upper bound on the tokens that finish the JSON: one per UTF-8 byte of the shortest
    closing text (every token is at least one byte) and the end-of-sequence token."""
    return len(plan.closing_text(shape).encode()) + 1


class ClosingPlan:
    """The shortest completion of a JSON value under one schema (None: any JSON)."""

    def __init__(self, schema: dict | None):
        self.root = schema if isinstance(schema, dict) else {}

    # -- the schema -----------------------------------------------------------------------

    def resolve(self, node: object) -> dict:
        """`node` with local `$ref`s followed (a schema that is not an object: {})."""
        for _ in range(MAX_DEPTH):
            if not isinstance(node, dict):
                return {}
            ref = node.get("$ref")
            if not isinstance(ref, str) or not ref.startswith("#"):
                return node
            node = self._pointer(ref)
        return {}

    def _pointer(self, ref: str) -> object:
        node: object = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def branch(self, node: object, container: str) -> dict:
        """The branch of `node` (anyOf/oneOf/allOf/type list) that writes a `container`
        ("{" or "["): the one whose shortest text is longest, to stay on the safe side."""
        node = self.resolve(node)
        options = [self.resolve(b) for k in ("anyOf", "oneOf", "allOf")
                   for b in node.get(k, []) or []]
        options = [b for b in options if self.minimal(b)[:1] == container]
        if not options:
            return node
        return max(options, key=lambda b: len(self.minimal(b)))

    def member(self, node: dict, key: str) -> object:
        props = node.get("properties") or {}
        if key in props:
            return props[key]
        extra = node.get("additionalProperties")
        return extra if isinstance(extra, dict) else {}

    def item(self, node: dict, index: int) -> object:
        prefix = node.get("prefixItems") or []
        if 0 <= index < len(prefix):
            return prefix[index]
        items = node.get("items")
        return items if isinstance(items, dict) else {}

    # -- shortest texts -------------------------------------------------------------------

    def minimal(self, node: object, depth: int = 0) -> str:
        """The shortest JSON text the schema `node` allows (close enough: a string pattern
        counts UNKNOWN_STRING characters)."""
        node = self.resolve(node)
        if depth > MAX_DEPTH:
            return "0"
        if "const" in node:
            return json.dumps(node["const"], separators=(",", ":"))
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min((json.dumps(v, separators=(",", ":")) for v in node["enum"]), key=len)
        options = [b for k in ("anyOf", "oneOf") for b in node.get(k, []) or []]
        if options:
            return min((self.minimal(b, depth + 1) for b in options), key=len)
        if node.get("allOf"):
            return self.minimal(node["allOf"][0], depth + 1)
        kind = node.get("type")
        if isinstance(kind, list):
            return min((self.minimal({**node, "type": k}, depth) for k in kind), key=len) \
                if kind else "0"
        return self._minimal_of_type(node, kind, depth)

    def _minimal_of_type(self, node: dict, kind: object, depth: int) -> str:
        if kind == "object" or (kind is None and "properties" in node):
            members = [f'"{k}":' + self.minimal(self.member(node, k), depth + 1)
                       for k in node.get("required", []) or []]
            return "{" + ",".join(members) + "}"
        if kind == "array" or (kind is None and "items" in node):
            count = int(node.get("minItems", 0) or 0)
            return "[" + ",".join(self.minimal(self.item(node, i), depth + 1)
                                  for i in range(min(count, 64))) + "]"
        if kind == "string":
            length = int(node.get("minLength", 0) or 0)
            if "format" in node:
                length = max(length, FORMAT_LENGTHS.get(node["format"], UNKNOWN_STRING))
            elif "pattern" in node:
                length = max(length, UNKNOWN_STRING)
            return '"' + "a" * length + '"'
        if kind in ("integer", "number"):
            low = node.get("minimum", node.get("exclusiveMinimum"))
            return str(low) if isinstance(low, (int, float)) and low > 0 else "0"
        if kind == "boolean":
            return "true"
        if kind == "null":
            return "null"
        return "0"  # any JSON value: a digit ends it

    # -- from where the output is -----------------------------------------------------------

    def closing_text(self, shape: JsonShape) -> str:
        """The shortest text that completes the JSON `shape` has read (an estimate)."""
        levels = shape.levels
        if not levels:
            if shape.in_string:
                return '"'
            return "" if shape.text.strip() else self.minimal(self.root)
        nodes = self._level_nodes(shape)
        parts = [self._pending_value(shape, nodes[-1])]
        for level, node in zip(reversed(levels), reversed(nodes), strict=True):
            parts.append(self._rest_of_array(level, node) if level.array else
                         self._rest_of_object(level, node, shape))
        return "".join(parts)

    def _level_nodes(self, shape: JsonShape) -> list[dict]:
        """The schema of each open array or object, outermost first."""
        levels = shape.levels
        nodes = [self.branch(self.root, "[" if levels[0].array else "{")]
        for parent, level in zip(levels, levels[1:], strict=False):
            node = nodes[-1]
            child = self.item(node, parent.count - 1) if parent.array else \
                self.member(node, parent.keys[-1] if parent.keys else "")
            nodes.append(self.branch(child, "[" if level.array else "{"))
        return nodes

    def _pending_value(self, shape: JsonShape, node: dict) -> str:
        """The rest of the value being written in the innermost level (or about to be)."""
        top = shape.levels[-1]
        if shape.in_string:
            if shape.in_key:
                return self._rest_of_key(shape, node)
            value = self.item(node, top.count - 1) if top.array else \
                self.member(node, top.keys[-1] if top.keys else "")
            return self._rest_of_string(self.resolve(value), shape.text[shape.string_start:])
        if shape.number is not None:
            return "0" if shape.text[-1:] in "-.eE+" else ""
        if top.array:
            return ""  # `_rest_of_array` counts elements still owed
        if top.after_colon and top.start is None:
            return self.minimal(self.member(node, top.keys[-1] if top.keys else ""))
        return ""

    def _rest_of_string(self, node: dict, typed: str) -> str:
        """The rest of a string value: its closing quote, after the characters an enum,
        minLength or format still owes."""
        enum = [v for v in node.get("enum", []) or [] if isinstance(v, str)]
        fitting = [v[len(typed):] for v in enum if v.startswith(typed)]
        if fitting:
            return max(fitting, key=len) + '"'
        owed = len(self.minimal(node)) - 2 - len(typed) if node.get("type") == "string" else 0
        return "a" * max(0, owed) + '"'

    def _rest_of_key(self, shape: JsonShape, node: dict) -> str:
        """The rest of a member key being written, its colon and shortest value: the
        costliest of the properties it may still become (the grammar forces the key)."""
        typed = shape.text[shape.string_start:]
        rests = [k[len(typed):] + '":' + self.minimal(v)
                 for k, v in (node.get("properties") or {}).items() if k.startswith(typed)]
        return max(rests, key=len, default='":' + self.minimal(self.member(node, typed)))

    @functools.cached_property
    def jump(self) -> int:
        """The most bytes one free token can add to the shortest closing text: a new array
        element, or a new optional member with its key, at their shortest (a schema that
        allows free keys counts FREE_KEY bytes of key)."""
        jumps, seen = [8], set()
        for node in self._all_nodes(self.root, 0, seen):
            if "items" in node or "prefixItems" in node:
                jumps.append(1 + max((len(self.minimal(self.item(node, i)))
                                      for i in range(len(node.get("prefixItems") or []) + 1)),
                                     default=1))
            required = set(node.get("required", []) or [])
            for key, value in (node.get("properties") or {}).items():
                if key not in required:
                    jumps.append(len(key.encode()) + 4 + len(self.minimal(value)))
            if isinstance(node.get("additionalProperties"), dict):
                jumps.append(FREE_KEY + 4 + len(self.minimal(node["additionalProperties"])))
        return max(jumps)

    def _all_nodes(self, node: object, depth: int, seen: set[int]):
        node = self.resolve(node)
        if depth > MAX_DEPTH or id(node) in seen:
            return
        seen.add(id(node))
        yield node
        children = [*(node.get("properties") or {}).values(), node.get("items"),
                    node.get("additionalProperties"), *(node.get("prefixItems") or []),
                    *(b for k in ("anyOf", "oneOf", "allOf") for b in node.get(k, []) or [])]
        for child in children:
            if isinstance(child, dict):
                yield from self._all_nodes(child, depth + 1, seen)

    def _rest_of_array(self, level, node: dict) -> str:
        owed = max(0, int(node.get("minItems", 0) or 0) - level.count)
        if not owed and level.after_comma:
            owed = 1  # `[1,` must have its next element
        rest = ",".join(self.minimal(self.item(node, level.count + i))
                        for i in range(min(owed, 64)))
        return ("" if level.after_comma or not rest else ",") + rest + "]"

    def _rest_of_object(self, level, node: dict, shape: JsonShape) -> str:
        written = set(level.keys)
        owed = [k for k in node.get("required", []) or [] if k not in written]
        if not owed and level.after_comma and not shape.in_key:
            owed = [""]  # `{"a":1,` must have its next member
        rest = ",".join(f'"{k}":' + self.minimal(self.member(node, k)) for k in owed)
        return ("" if level.after_comma or not rest else ",") + rest + "}"


@functools.lru_cache(maxsize=256)  # per request, and requests often share a schema
def closing_plan(schema_text: str | None) -> ClosingPlan:
    """The plan for a JSON schema's text (None or unreadable: any JSON object)."""
    try:
        schema = json.loads(schema_text) if schema_text else None
    except ValueError:
        schema = None
    return ClosingPlan(schema)


class SteerMasks:
    """The token classes a closing draw is narrowed to, as packed bitmask rows (xgrammar's
    int32 layout, ANDed into a row like the UTF-8 masks; kiln.structured.constraint)."""

    def __init__(self, texts: list[str], stop_token_ids: list[int]):
        words = (len(texts) + 31) // 32
        self.close_string = _packed([i for i, t in enumerate(texts) if _closes_string(t)],
                                    words)
        closers = [i for i, t in enumerate(texts) if t.strip() and not t.strip().strip("]}")]
        self.closers = _packed(closers + [i for i in stop_token_ids if i < len(texts)], words)
        self.comma = _packed([i for i, t in enumerate(texts)
                              if t.strip()[:1] == "," and not t.strip()[1:].strip('"')], words)
        self.no_comma = _packed([i for i, t in enumerate(texts) if "," not in t], words)
        self.string_no_comma = _packed([i for i, t in enumerate(texts)
                                        if '"' not in t or _closes_string(t)], words)

    def for_shape(self, shape: JsonShape, now: bool) -> tuple[torch.Tensor, ...]:
        """The classes, in order of preference, for the draw after what `shape` has read:
        `now`, close at once; else open nothing new (no comma, no first element or member)
        but let strings and numbers go on."""
        if now:
            return (self.close_string,) if shape.in_string else (self.closers, self.comma)
        if shape.in_string:
            return (self.string_no_comma,)
        top = shape.levels[-1] if shape.levels else None
        if top is not None and top.start is None and not top.after_colon and \
                not top.after_comma and not (top.count if top.array else top.keys):
            return (self.closers, self.no_comma)  # `[` or `{` just opened
        return (self.no_comma,)


def _closes_string(text: str) -> bool:
    """`"`, then only closers, a colon or a quote (`"}`, `"]}`, `":`, `":"`): it ends the
    string without a comma that would begin something new."""
    return text[:1] == '"' and not text[1:].replace(" ", "").strip(']}:"')


def _packed(ids: list[int], words: int) -> torch.Tensor:
    """A packed int32 bitmask row [words] with the bits of `ids` set."""
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[torch.tensor(ids, dtype=torch.int64)] = 1
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
