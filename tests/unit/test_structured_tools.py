"""Tool calls in model text: exact parses, streaming that reassembles to the same calls however
the text is chunked, prompts for templates without tool support, and call grammars."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.structured.gateway import make_tool, plan_tools
from kiln.structured.parsers import ObjectScanner, ToolCallStream, parse_tool_calls
from kiln.structured.tools import FORMATS, Tool, call_grammar, choose_format, inject_tools

HERMES, BARE = FORMATS["hermes"], FORMATS["json"]

OUTPUTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"x": "</tool_", "y": [1, {"z": "}"}]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"name": "not me", "q": "a\\"b"}, "name": "search"}\n'
    "</tool_call>",
    "No tools needed: 2 < 3 and <tool is not a tag.",
    'Before <tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</tool_call>\nAfter.',
    '<tool_call>\n{"name": "cut", "arguments": {"a": 1',  # max_tokens ran out
]


def _stream(text: str, cuts: list[int], fmt=HERMES):
    stream, content, calls = ToolCallStream(fmt), "", {}
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for d in deltas:
        content += d.content
        for c in d.calls:
            entry = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert entry["id"] is None and entry["arguments"] == ""  # id and name first
                entry.update(id=c.id, name=c.name)
            entry["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_calls_parse_exactly():
    parsed = parse_tool_calls(OUTPUTS[0], HERMES)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert parsed.calls[0].id.startswith("call_") and len(parsed.calls[0].id) == 29
    two = parse_tool_calls(OUTPUTS[1], HERMES)
    assert two.content is None and [c.name for c in two.calls] == ["a", "b"]
    assert json.loads(two.calls[0].arguments) == {"x": "</tool_", "y": [1, {"z": "}"}]}
    swapped = parse_tool_calls(OUTPUTS[2], HERMES).calls[0]
    assert swapped.name == "search" and json.loads(swapped.arguments)["name"] == "not me"
    assert parse_tool_calls(OUTPUTS[3], HERMES).calls == []
    assert parse_tool_calls(OUTPUTS[4], HERMES).content == "Before\nAfter."


def test_a_broken_call_stays_content():
    parsed = parse_tool_calls(OUTPUTS[5], HERMES)
    assert parsed.calls == [] and parsed.content == OUTPUTS[5]
    bad = parse_tool_calls("<tool_call>\n[1, 2]\n</tool_call>", HERMES)
    assert bad.calls == [] and bad.content.startswith("<tool_call>")


def test_bare_json_calls():
    one = parse_tool_calls(' {"name": "f", "parameters": {"a": [1, 2]}}', BARE)
    assert one.content is None and (one.calls[0].name, one.calls[0].arguments) == (
        "f", '{"a": [1, 2]}')
    many = parse_tool_calls('{"name": "f", "parameters": {}}\n{"name": "g", "arguments": '
                            '{"b": 1}}', BARE)
    assert [c.name for c in many.calls] == ["f", "g"]
    listed = parse_tool_calls('[{"name": "f", "arguments": {"a": 1}}]', BARE)
    assert [json.loads(c.arguments) for c in listed.calls] == [{"a": 1}]
    assert parse_tool_calls("Paris is the capital.", BARE).content == "Paris is the capital."
    assert parse_tool_calls('{"not": "a call"}', BARE).calls == []


@pytest.mark.parametrize("index", range(len(OUTPUTS) - 1))
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
@settings(max_examples=60, deadline=None)
def test_streaming_reassembles_to_the_parsed_calls(index, cuts):
    text = OUTPUTS[index]
    content, calls = _stream(text, cuts)
    parsed = parse_tool_calls(text, HERMES)
    assert (content or None) == parsed.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in parsed.calls]


@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=20))
@settings(max_examples=30, deadline=None)
def test_bare_json_streams_whole_calls_or_content(cuts):
    text = '{"name": "f", "parameters": {"a": "x"}}'
    content, calls = _stream(text, cuts, BARE)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [
        ("f", '{"a": "x"}')]
    content, calls = _stream("Plain answer, no call.", cuts, BARE)
    assert content == "Plain answer, no call." and calls == []


def test_a_call_cut_off_streams_as_far_as_it_got():
    content, calls = _stream(OUTPUTS[5], [3, 17, 30])
    assert content == "" and calls == [{"id": calls[0]["id"], "name": "cut",
                                        "arguments": '{"a": 1'}]


def test_object_scanner_spans():
    scanner = ObjectScanner()
    text = '{"a": 12 , "b": {"c": "}"}, "d": "x\\"y", "e": [true, null]}'
    for ch in text:
        scanner.feed(ch)
    assert scanner.done
    assert {k: scanner.value(k) for k in "abde"} == {
        "a": "12", "b": '{"c": "}"}', "d": '"x\\"y"', "e": "[true, null]"}


# -- choosing formats, prompts, plans, grammars ----------------------------------------------------

def test_format_follows_the_template_or_the_flag():
    assert choose_format("auto", "{{ '<tool_call>' }} {% if tools %}") is HERMES
    assert choose_format("auto", "{% for t in tools %}{{ t | tojson }}{% endfor %}") is BARE
    assert choose_format("auto", "{{ messages }}") is HERMES  # the prompt teaches hermes
    assert choose_format("json", None) is BARE
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_format("mystery", None)


def test_tools_and_tool_turns_are_written_into_the_conversation():
    tools = [Tool("get_weather", "Weather by city", {"type": "object"})]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    out = inject_tools(conversation, tools, HERMES)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                      '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n'
                      "</tool_response>"}


def test_plans_check_names_and_choices():
    tools = [make_tool("f", None, None), make_tool("g", "G", {"type": "object"})]
    assert plan_tools(tools, None, True, "auto", None).choice == "auto"
    assert plan_tools(tools, "g", True, "auto", None).grammar is not None
    assert plan_tools(tools, "none", True, "auto", None).grammar is None
    assert plan_tools([], None, True, "auto", None) is None
    from kiln.engine.limits import RequestError
    for args, param in (((tools, "h", True, "auto", None), "tool_choice"),
                        (([], "required", True, "auto", None), "tool_choice"),
                        (([tools[0], tools[0]], None, True, "auto", None), "tools")):
        with pytest.raises(RequestError) as err:
            plan_tools(*args)
        assert err.value.param == param
    with pytest.raises(RequestError):
        make_tool("bad name!", None, None)


@pytest.mark.parametrize("fmt", [HERMES, BARE], ids=["hermes", "json"])
def test_call_grammars_accept_valid_calls_only(fmt):
    import xgrammar as xgr

    from kiln.testing.tiny import make_tokenizer
    tok = make_tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    tools = [Tool("add", None, {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}),
             Tool("echo", None, {"type": "object", "properties": {"s": {"type": "string",
                                                                         "maxLength": 3}}})]

    def accepts(choice: str, text: str, parallel: bool = True) -> bool:
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(
            call_grammar(tools, fmt, choice, parallel)))
        return m.accept_string(text) and m.is_completed()

    good = fmt.call_text("add", '{"a": 3}')
    assert accepts("required", good) and accepts("add", good)
    assert not accepts("echo", good)
    assert not accepts("required", fmt.call_text("add", '{"a": "3"}'))
    assert not accepts("required", fmt.call_text("echo", '{"s": "toolong"}'))
    assert not accepts("required", "")  # at least one call
    two = good + "\n" + fmt.call_text("echo", '{"s": "hi"}')
    assert accepts("required", two) and not accepts("required", two, parallel=False)


def test_a_template_that_renders_tools_gets_them_as_objects():
    from kiln.serve.frontend import Frontend
    from kiln.serve.protocol import ChatMessage
    from kiln.testing.tiny import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    frontend = Frontend(tok)
    assert frontend.renders_tools
    messages = [ChatMessage(role="user", content="hi"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
                    "name": "f", "arguments": '{"a": 1}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="ok")]
    text = tok.decode(frontend.chat_prompt(messages, tools=[Tool("f", None, {})]))
    assert text.startswith("TOOLS:f;") and 'CALL f {"a": 1}' in text and "[tool]ok" in text
    assert not Frontend(make_tokenizer()).renders_tools  # the tiny ChatML template ignores them
