"""The closing budget's estimate (kiln.structured.closing): the shortest text that finishes a
JSON value from where the output is, per schema, and the token classes a closing draw is
narrowed to."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.structured.closing import SteerMasks, closing_plan, tokens_to_close
from kiln.structured.json_limits import JsonShape

PART = {"type": "object", "properties": {"name": {"type": "string"}, "quantity": {
    "type": "integer", "minimum": 1}}, "required": ["name", "quantity"]}
ORDER = {"$defs": {"Part": PART, "Rating": {"enum": ["high", "low"]}}, "type": "object",
         "properties": {"title": {"type": "string"},
                        "items": {"type": "array", "items": {"$ref": "#/$defs/Part"}},
                        "rating": {"$ref": "#/$defs/Rating"},
                        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        "day": {"type": "string", "format": "date"}},
         "required": ["title", "items", "rating"]}


def _closing(prefix: str, schema: dict | None = ORDER) -> str:
    shape = JsonShape()
    shape.feed(prefix)
    return closing_plan(json.dumps(schema) if schema is not None else None).closing_text(shape)


@pytest.mark.parametrize("prefix, rest", [
    ("", '{"title":"","items":[],"rating":"low"}'),
    ('{"title":"Desk l', '","items":[],"rating":"low"}'),
    ('{"title":"x","items":[{"name":"pen","quantity":1', '}],"rating":"low"}'),
    ('{"title":"x","items":[{"name":"pen"', ',"quantity":1}],"rating":"low"}'),
    ('{"title":"x","items":[{"name":"a","quantity":1},', '{"name":"","quantity":1}],'
     '"rating":"low"}'),
    ('{"title":"x","items":[],"rating":"low","no', 'te":""}'),  # the key it must become
    ('{"title":"x","items":[],"rating":"low","note":', '""}'),
    ('{"title":"x","items":[],"rating":"high","day":"2', 'a' * 9 + '"}'),  # a date owes 9
    ('{"title":"x","items":[],"rating":"h', 'igh"}'),
    ('{"title":"x","items":[],"rating":"low"}', ""),
])
def test_the_shortest_closing_text_follows_the_schema(prefix, rest):
    import jsonschema
    assert _closing(prefix) == rest
    jsonschema.validate(json.loads(prefix + rest), ORDER)


def test_any_json_closes_its_open_containers():
    assert _closing('{"a":[1,{"b":"x', None) == '"}]}'
    assert _closing('{"a":[1,', None) == "0]}"


def test_the_jump_is_the_costliest_new_element_or_optional_member():
    plan = closing_plan(json.dumps(ORDER))
    element = len(',{"name":"","quantity":1}')
    assert plan.jump == max(element, len(',"day":') + len('"aaaaaaaaaa"'))
    assert tokens_to_close(plan, JsonShape()) == len('{"title":"","items":[],"rating":"low"}') + 1


def test_steering_classes_pick_closers_then_commas():
    texts = ['"', '"}', '",', "a", "}", "]", "}]", ",", ',"', "1", "},{", ":", '":"', "<eos>"]
    masks = SteerMasks(texts, stop_token_ids=[13])

    def ids(mask: torch.Tensor) -> list[int]:
        bits = (mask[:, None].to(torch.int64) >> torch.arange(32)) & 1
        return [i for i in range(len(texts)) if bits.flatten()[i]]

    assert ids(masks.close_string) == [0, 1, 12]
    assert ids(masks.closers) == [4, 5, 6, 13]
    assert ids(masks.comma) == [7, 8]
    in_string = JsonShape()
    in_string.feed('{"a":"xy')
    assert [ids(m) for m in masks.for_shape(in_string, now=True)] == [[0, 1, 12]]
    assert ids(masks.for_shape(in_string, now=False)[0]) == [0, 1, 3, 4, 5, 6, 7, 9, 10, 11,
                                                             12, 13]
    opened = JsonShape()
    opened.feed('{"a":[')
    assert [ids(m) for m in masks.for_shape(opened, now=False)][0] == [4, 5, 6, 13]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": [1, 2], "required": "name"},
    {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]},
    {"type": "array", "items": True, "minItems": "3"},
])
def test_an_odd_schema_never_breaks_the_estimate_silently(schema):
    """Schemas xgrammar may still compile but the estimate cannot read: either an estimate
    comes out, or one of the errors the hooks catch (then the request has no budget)."""
    shape = JsonShape()
    shape.feed("{" if schema["type"] == "object" else "[")
    plan = closing_plan(json.dumps(schema))
    try:
        assert isinstance(tokens_to_close(plan, shape) + plan.jump, int)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError):
        pass
