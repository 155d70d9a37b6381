"""The tool-call parsers on crafted model text: whole outputs, unclosed calls, bad JSON."""

import json

import pytest

from hyla.server.tool_parsers import extract, make_parser, marker_hold

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_two_calls_and_content():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>')
    content, calls = extract(make_parser("hermes"), text, TOOLS)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert calls[0].id != calls[1].id


def test_hermes_unclosed_last_call_counts_at_the_end_only():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    parser = make_parser("hermes")
    assert parser.calls(text, TOOLS, final=False) == []
    content, calls = extract(parser, text, TOOLS)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("text", ['<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
                                  '<tool_call>["not", "an", "object"]</tool_call>',
                                  "no tool call at all"])
def test_unparseable_calls_are_content(text):
    content, calls = extract(make_parser("hermes"), text, TOOLS)
    assert content == text and calls == []


def test_qwen3_coder_types_values_by_the_schema():
    text = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    content, calls = extract(make_parser("qwen3_coder"), text, TOOLS)
    assert content == "I'll look.\n"
    assert _calls(calls) == [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2]})]


def test_qwen3_coder_string_parameter_keeps_digits_as_text():
    text = "<tool_call><function=get_weather><parameter=city>\n2024\n</parameter></function></tool_call>"
    _, calls = extract(make_parser("qwen3_coder"), text, TOOLS)
    assert _calls(calls) == [("get_weather", {"city": "2024"})]


def test_kimi_k2_ids_names_and_arguments():
    text = ("Checking<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Lima"}<|tool_call_end|><|tool_call_begin|>'
            'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Quito"}<|tool_call_end|>'
            "<|tool_calls_section_end|>")
    content, calls = extract(make_parser("kimi_k2"), text, TOOLS)
    assert content == "Checking"
    assert _calls(calls) == [("get_weather", {"city": "Lima"}), ("get_weather", {"city": "Quito"})]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    partial = text[: text.index("<|tool_call_end|>")]  # the first call is still being written
    assert make_parser("kimi_k2").calls(partial[partial.index("<|tool_calls"):], TOOLS, final=False) == []


def test_marker_hold_and_unknown_parser():
    assert marker_hold("hello <tool", "<tool_call>") == 5
    assert marker_hold("hello", "<tool_call>") == 0
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("mistral9")


@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_glm_calls_both_spellings_typed_by_the_schema(name):
    text = ("Let me see.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true"
            "</arg_value>\n</tool_call>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value> Oslo "
            "</arg_value><arg_key>hours</arg_key><arg_value>[1, 2]</arg_value></tool_call>")
    content, calls = extract(make_parser(name), text, TOOLS)
    assert content == "Let me see.\n"
    assert _calls(calls) == [("get_weather", {"city": "2024", "days": 3, "metric": True}),
                             ("get_weather", {"city": "Oslo", "hours": [1, 2]})]
    unclosed = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>"
    assert make_parser(name).calls(unclosed, TOOLS, final=False) == []
    assert _calls(make_parser(name).calls(unclosed, TOOLS, final=True)) == [("get_weather", {"city": "Rome"})]
    assert extract(make_parser(name), "<tool_call>\n</tool_call>", TOOLS) == ("<tool_call>\n</tool_call>", [])
