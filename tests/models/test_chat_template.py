"""Chat templates render exactly as transformers' apply_chat_template(..., tokenize=False): the
same text for the same template, messages and keywords (loopcontrols, tojson's arguments,
strftime_now, raise_exception, namespace, generation blocks, continue_final_message, template
kwargs), on the tiny word-level tokenizer read by both."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError, TemplateError

from hyla.models import load_tokenizer
from hyla.models.chat_template import render_chat_template, special_tokens
from tests.oracles.kimi_checkpoint import write_tokenizer

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "a dog"}, {"role": "user", "content": "the sun"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"later\"",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Zürich or Oslo"}},
                                               "required": ["city"]}}}]

# A Qwen3-style template (written for this test): tools in a system block, earlier tool calls as
# JSON, tool results grouped in a user turn, reasoning kept after the last user query only, and
# enable_thinking=false writing an empty think block into the generation prompt.
QWEN3_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set i = messages | length - 1 - loop.index0 %}
    {%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = i %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = message.reasoning_content or '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}
            {%- set content = content.split('</think>')[-1].lstrip() %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

TOOL_LOOP = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Oslo?"},
             {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
              "tool_calls": [{"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sun, 21°C"},
             {"role": "tool", "tool_call_id": "c2", "content": "no wind"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("chat_template")
    write_tokenizer(path)
    ours = load_tokenizer(path)
    # the special tokens hyla reads from tokenizer_config.json, given to transformers directly (its
    # loader wants {"__type": "AddedToken"} objects where the config has {"content": ...})
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **special_tokens(ours.config))
    ref.chat_template = ours.chat_template
    return ours, ref


def _both(tokenizers, template: str, messages, **kwargs) -> tuple[str, str]:
    ours, ref = tokenizers
    kwargs.setdefault("add_generation_prompt", False)  # hyla's default is True, transformers' False
    return (ours.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs),
            ref.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs))


CASES = {
    "loopcontrols": ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "{{ m.role }}: {{ m.content }}\n{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}", {}),
    "tojson arguments": ("{% for t in tools %}{{ t | tojson(indent=2) }}\n{{ t | tojson(separators=(',', ':'), "
                         "sort_keys=true) }}\n{{ t | tojson(ensure_ascii=true) }}\n{{ t | tojson }}{% endfor %}",
                         {"tools": TOOLS}),
    "strftime_now": ("Today is {{ strftime_now('%Y-%m-%d') }}.{{ messages[-1].content }}", {}),
    "enable_thinking": ("{{ messages[-1].content }}|{% if enable_thinking is defined %}{{ enable_thinking }}"
                        "{% else %}unset{% endif %}|{{ reasoning_effort | default('none') }}",
                        {"enable_thinking": False, "reasoning_effort": "low"}),
    "special tokens": ("{{ bos_token }}[{{ eos_token }}][{{ pad_token }}][{{ unk_token is defined }}]"
                       "[{{ sep_token is defined }}]{{ messages | length }}", {}),
    "kwargs over special tokens": ("{{ bos_token }}{{ messages[0].content }}", {"bos_token": "<B>"}),
    "generation block": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                         "{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}", {}),
    "dict and namespace": ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                           "{% endfor %}{{ dict(count=ns.n, keys=dict.fromkeys(['a', 'b'])) | tojson }}", {}),
    "generation prompt": ("{% for m in messages %}{{ m.content }};{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}", {"add_generation_prompt": True}),
    "documents": ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}",
                  {"documents": [{"title": "a", "text": "the cat"}, {"title": "b", "text": "sat"}]}),
    "whitespace control": ("{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n"
                           "{% endfor %}", {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_renders_as_transformers(tokenizers, name):
    template, kwargs = CASES[name]
    ours, ref = _both(tokenizers, template, MSGS, **kwargs)
    assert ours == ref


def test_html_characters_are_not_escaped_and_none_keys_are_dropped(tokenizers):
    template = "{% for m in messages %}{{ m | tojson }}{{ 'name' in m }}{% endfor %}"
    msgs = [{"role": "user", "content": "<b> & 'q' é", "name": None}]
    ours, ref = _both(tokenizers, template, msgs)
    assert ours == ref == '{"role": "user", "content": "<b> & \'q\' é"}False'


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("messages", [MSGS, TOOL_LOOP], ids=["chat", "tool loop"])
def test_a_qwen3_style_template_with_tools_and_thinking(tokenizers, messages, enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours, ref = _both(tokenizers, QWEN3_STYLE, messages, tools=TOOLS, add_generation_prompt=True, **kwargs)
    assert ours == ref
    assert '"description": "Weather <now> & \\"later\\""' in ours and "Zürich" in ours
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    if messages is TOOL_LOOP:  # the reasoning after the last user query is kept; results grouped
        assert "<think>\nI should call the tool.\n</think>" in ours
        assert ours.count("<tool_response>") == 2 and ours.count("<|im_start|>user") == 2


def test_reasoning_under_any_name_reaches_reasoning_content(tokenizers):
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }};{% endfor %}"
    msgs = [{"role": "assistant", "content": "a", "reasoning": "r1"},
            {"role": "assistant", "content": "b", "thinking": "r2"},
            {"role": "assistant", "content": "c", "reasoning_content": "r3", "thinking": "t3"}]
    ours, ref = _both(tokenizers, template, msgs)
    assert ours == ref == "r1|r1|a;r2|r2|b;r3|t3|c;"


@pytest.mark.parametrize("final", ["the answer is", "the answer is ", "  spaced  "])
def test_continue_final_message(tokenizers, final):
    ours_tok = tokenizers[0]
    msgs = MSGS[:2] + [{"role": "assistant", "content": final}]
    for template in (ours_tok.chat_template, "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}"
                                              "</s>{% endfor %}"):
        ours, ref = _both(tokenizers, template, msgs, continue_final_message=True)
        assert ours == ref
        assert ours.rstrip().endswith(final.strip()) and not ours.endswith("</s>")


def test_continue_final_message_of_the_reasoning(tokenizers):
    template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }}</s>{% endfor %}")
    msgs = MSGS[:2] + [{"role": "assistant", "content": "", "reasoning_content": "let me see"}]
    ours, ref = _both(tokenizers, template, msgs, continue_final_message="reasoning_content")
    assert ours == ref and ours.endswith("<think>let me see")


@pytest.mark.parametrize("template,messages,kwargs,error", [
    ("{{ messages }}", MSGS, {"continue_final_message": True, "add_generation_prompt": True}, ValueError),
    ("{% for m in messages %}{{ m.role }}{% endfor %}", MSGS, {"continue_final_message": True}, ValueError),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", MSGS[:1] + [{"role": "assistant"}],
     {"continue_final_message": True}, ValueError),
    ("{% for m in messages %}{{ m.content[:2] }}{% endfor %}", MSGS, {"continue_final_message": True}, ValueError),
    ("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}", MSGS[1:], {},
     TemplateError),
    ("{% set ns = namespace(_x=1) %}{{ ns._x }}", MSGS, {}, SecurityError),
    ("{% set ns = namespace() %}{% set ns._y = 1 %}", MSGS, {}, SecurityError),
    ("{{ messages.append(1) }}", MSGS, {}, SecurityError),  # the sandbox is immutable
])
def test_failures_match_transformers(tokenizers, template, messages, kwargs, error):
    ours, ref = tokenizers
    kwargs.setdefault("add_generation_prompt", False)
    with pytest.raises(error) as ref_err:
        ref.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    with pytest.raises(error) as our_err:
        ours.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    if error is TemplateError:  # the template's own message
        assert str(our_err.value) == str(ref_err.value) == "system first"


def test_token_ids_and_the_tokenizers_own_template(tokenizers):
    ours, ref = tokenizers
    ids = ours.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    assert ids == ref.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(MSGS) == ref.apply_chat_template(MSGS, add_generation_prompt=True,
                                                                     tokenize=False)


def test_render_without_a_tokenizer():
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "unk_token": None}
    assert special_tokens(config) == {"bos_token": "<s>", "eos_token": "</s>"}
    text = render_chat_template("{{ bos_token }}{{ messages[0].content }}{{ x }}{{ template }}",
                                [{"role": "user", "content": "hi"}], **special_tokens(config), x=3, template="!")
    assert text == "<s>hi3!"
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(TypeError, match="multiple values"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": "hi"}], messages=[])
