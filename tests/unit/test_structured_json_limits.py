"""kiln.structured.json_limits exactly: where each bound breaks, and what stays legal."""

from __future__ import annotations

import pytest

from kiln.structured.json_limits import (
    Breach,
    JsonLimits,
    JsonShape,
    limits_for_schema,
    tag_json_begins,
)
from kiln.structured.tools import FORMATS, Tool, call_grammar


def first_breach(text: str, shape: JsonShape | None = None) -> tuple[int, Breach] | None:
    shape = shape or JsonShape()
    for i, ch in enumerate(text):
        found = shape.feed(ch)
        if found is not None:
            return i, found[0]
    return None


@pytest.mark.parametrize("text, at, breach", [
    ('{"a":' + "1" * 30 + "}", 5 + 16, Breach.NUMBER_DIGITS),
    ('{"a":-1.' + "2" * 30 + "}", 8 + 15, Breach.NUMBER_DIGITS),
    ('{"a":0.' + "0" * 30 + "}", 7 + 15, Breach.NUMBER_DIGITS),  # 16 zeros, then no more
    ('{"a":1e' + "1" * 9 + "}", 7 + 3, Breach.EXPONENT_DIGITS),
    ('{"a":"' + "1234567890" * 5 + '"}', 6 + 32, Breach.STRING_DIGITS),
    ('{"a":"' + "x" * 50 + '"}', 6 + 32, Breach.STRING_RUN),
    ('{"a":[' + ",".join(['{"n":"1000","q":[1,2]}'] * 5) + "]}", 6 + 3 * 22 + 2,
     Breach.REPEATED_ELEMENT),
    ('["x","x","x","x"]', 12, Breach.REPEATED_ELEMENT),
    ("[" + ",".join(["0"] * 12) + "]", 16, Breach.REPEATED_ELEMENT),  # scalars: 8 copies
    ('["ab","cd","ab","cd","ab","cd","ab"]', 30, Breach.REPEATED_ELEMENT),  # alternating
    ("[" + ",".join(f'{{"n":"Cities","q":{i}}}' for i in range(1, 9)) + "]",
     1 + 6 * 20 + 5, Breach.REPEATED_ELEMENT),  # counting up: 6 objects but for numbers
    ('{"a":"x","b":"x","c":"x","d":"x"}', 24, Breach.REPEATED_MEMBER),  # one value 3 times
    ('{"o":{"a":[1],"b":[1],"c":[1],"d":[1]}}', 29, Breach.REPEATED_MEMBER),
    ("{" + ",".join(f'"k{i}":0' for i in range(10)) + "}", 1 + 8 * 6 + 7,
     Breach.REPEATED_MEMBER),  # scalars: 8 copies
    ('{"name":"Nyx' + "-Ki" * 5, 12 + 3 * 4 - 1, Breach.STRING_LOOP),  # a chunk 4 times
    ('{"s":"' + "apple_banana_grape_" * 4, 6 + 19 * 3 - 1, Breach.STRING_LOOP),  # long: 3
])
def test_each_bound_breaks_where_documented(text, at, breach):
    assert first_breach(text) == (at, breach)


@pytest.mark.parametrize("text", [
    '{"pi":3.141592653589793,"big":1234567890123456,"tiny":0.000000000000001,"e":1e308}',
    '{"id":"' + "0" * 32 + '","uuid":"123e4567-e89b-12d3-a456-426614174000"}',
    '{"xs":[0,0,0,0,0,0,0,0],"ys":["a","a","a"],"zs":[[1],[1],[1]]}',
    '{"s":"a\\\\\\"' + "b" * 32 + '"}',  # escapes break runs
    '["x","x","y","x","x","y"]',
    '{"a":"x","b":"x","c":"y","d":"x","e":"x","f":{"x":"x"},"g":"x","h":"x"}',
    '{"x":"a","y":["a","a"],"z":{"x":"a","y":"b"},"w":"a"}',  # values of one object only
    "[" + ",".join(f'{{"x":{i},"y":{i}}}' for i in range(20)) + "]",  # no string member
    "[" + ",".join(f'{{"date":"2024-01-{i:02d}","v":1}}' for i in range(1, 20)) + "]",
    '{"s":"ha ha ha","t":"0x0000000000","u":"abcabcabc","v":"' + "ab-cd-ef-gh-ij-" * 2 + '"}',
])
def test_legitimate_json_breaks_nothing(text):
    assert first_breach(text) is None


ITEMS = [f'{{"name":"Item{i}","quantity":{10 if i == 1 else i},"unit_price":{i}.5}}'
         for i in range(1, 9)]
SONGS = [f'{{"name":"Song {i}","artist":"Artist","duration_s":{180 + i}}}' for i in range(1, 9)]


@pytest.mark.parametrize("elements", [ITEMS, SONGS])
def test_objects_counting_inside_their_strings_end_the_array(elements):
    """A counter ending a string (`Item1`, `Song 2`) counts as a number: the sixth such
    object's comma is the breach; five are still fine."""
    text = '{"xs":[' + ",".join(elements) + "]}"
    sixth_comma = len('{"xs":[') + sum(map(len, elements[:6])) + 5
    assert first_breach(text) == (sixth_comma, Breach.REPEATED_ELEMENT)
    assert first_breach('{"xs":[' + ",".join(elements[:5]) + "]}") is None


@pytest.mark.parametrize("text", [
    "[" + ",".join(f'{{"at":"2024-01-05T{h:02d}:00","v":1}}' for h in range(12)) + "]",
    "[" + ",".join(f'{{"id":"{i}","sku":"A-{i}7x","v":1}}' for i in range(1, 12)) + "]",
    "[" + ",".join(f'{{"name":"Item{i}","kind":"{k}"}}' for i, k in enumerate("abcdefgh")) + "]",
])
def test_strings_that_differ_in_more_than_a_trailing_counter_are_not_counting(text):
    assert first_breach(text) is None


def test_a_string_that_fills_its_bound_three_times_must_close():
    twice = '{"a":"' + "1" * 32 + "ex" + "1" * 32
    assert first_breach(twice + "1") == (len(twice), Breach.STRING_RUN)
    thrice = twice + "ex" + "1" * 32
    assert first_breach(thrice + "1") == (len(thrice), Breach.STRING_END)
    assert Breach.STRING_END.banned_starts("1") == ""  # everything but a closing quote


def test_a_fork_leaves_the_state_alone():
    shape = JsonShape()
    shape.feed('{"a":' + "1" * 16)
    assert shape.fork().feed("1") == (Breach.NUMBER_DIGITS, "1")
    assert shape.feed("}") is None and shape.text.endswith("1}")


def test_schema_bounds_widen_the_digit_bound():
    assert limits_for_schema(None).number_digits == 16
    assert limits_for_schema('{"type":"number","maximum":5}').number_digits == 16
    assert limits_for_schema('{"properties":{"n":{"maximum":1e25}}}').number_digits == 27
    assert limits_for_schema('{"minimum":-100000000000000000000}').number_digits == 22


def test_tool_call_grammars_name_where_their_json_begins():
    tools = [Tool("f", None, {"type": "object"}), Tool("g", None, {"type": "object"})]
    hermes, bare = FORMATS["hermes"], FORMATS["json"]
    assert tag_json_begins(call_grammar(tools, hermes, "required")) == (
        '<tool_call>\n{"name": "f", "arguments": ', '<tool_call>\n{"name": "g", "arguments": ')
    assert tag_json_begins(call_grammar(tools, bare, "g")) == ('{"name": "g", "parameters": ',)
    whole = '{"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {}}}'
    assert tag_json_begins(whole) == ()
    free = '{"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": ' \
           '{"type": "any_text"}, "end": "</a>"}}'
    assert tag_json_begins(free) is None and tag_json_begins("not json") is None


def test_a_tagged_shape_follows_only_the_json_after_a_begin():
    """Free text and the tags around a call are not JSON: quotes, digits and brackets there
    break nothing; each call's arguments are held to the limits from their first character."""
    begin = '<tool_call>\n{"name": "f", "arguments": '
    shape = JsonShape.tagged(JsonLimits(), (begin,))
    prose = 'He said "' + "1" * 40 + '" [x, x, x, x] and {"a":' + "2" * 30 + "\n"
    call = begin + '{"n": 5, "s": "ok"}}\n</tool_call>\n'
    assert first_breach(prose + call + prose, shape) is None
    assert not shape.in_string and shape.outside
    again = begin + '{"n": ' + "3" * 20
    assert first_breach(again, shape) == (len(begin) + 6 + 16, Breach.NUMBER_DIGITS)
