"""Chat templates as vLLM renders them (issue 56 point 2): content parts joined into text
wherever the template does not itself loop over a message's content, decided from the
template's syntax tree; a request's `chat_template` (trusted servers only),
`chat_template_kwargs` and `continue_final_message`. Checked against transformers'
`apply_chat_template` on the same tokenizer with string content, on the tiny tokenizer
make-checkpoint writes and templates shaped as published ones (Qwen3's, Gemma 3's)."""

from __future__ import annotations

import types

import pytest

from coordinator.serving.app import BadRequest, OpenAIServer
from coordinator.serving.text import TokenizerError, template_reads_parts

# Qwen3's way: content kept only when it is a string, '' otherwise; thinking by a variable
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Gemma 3's way: a slice of the messages, and a loop over a list content's text parts
GEMMA3 = (
    "{%- set loop_messages = messages[0:] -%}"
    "{%- for message in loop_messages -%}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
VIA_VARIABLE = (
    "{% for m in messages %}{% set parts = m.content %}"
    "{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}"
)
THROUGH_A_FILTER = (
    "{% for m in messages %}"
    "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
    "{% endfor %}{% endfor %}"
)


def server(tokenizer, *, trusted: bool = False):
    """What the server's request handling reads of itself, over `tokenizer`."""
    return types.SimpleNamespace(tokenizer=tokenizer, trust_request_chat_template=trusted)


def chat_ids(self, **body) -> list[int]:
    """The server's own rendering of a chat body (its class's method, no Serve)."""
    return OpenAIServer.func_or_class._chat_ids(self, body)[0].tolist()


def reference(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("template", "reads"),
    [
        (QWEN3, False),
        (GEMMA3, True),
        (VIA_VARIABLE, True),
        (THROUGH_A_FILTER, True),
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", False),
        ("{% for message in messages %}{{ message.content | trim }}{% endfor %}", False),
        ("{% for x in messages %}{% for c in x.content %}{{ c }}{% endfor %}{% endfor %}", True),
        ("{% for message in messages %}{{ message.content", False),  # does not parse
    ],
)
def test_whether_a_template_reads_parts_comes_from_its_syntax_tree(template, reads) -> None:
    assert template_reads_parts(None, template) is reads


PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "the cat sat"}, {"type": "text", "text": "on"}],
    },
]
JOINED = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the cat sat\non"},
]


@pytest.mark.parametrize("template", [QWEN3, None])
def test_text_parts_reach_a_string_template_as_its_text(tokenizer, template) -> None:
    """Issue 56's silent wrong answer: parts sent to a Qwen3-style template reached it as ''
    (13 prompt tokens against 19). Joined, they give what the same text as strings gives."""
    self = server(tokenizer, trusted=True)
    ours = chat_ids(self, messages=PARTS, chat_template=template)
    assert ours == reference(tokenizer, JOINED, chat_template=template, add_generation_prompt=True)
    if template is QWEN3:  # what passing the parts would have given: the text lost
        empty = reference(tokenizer, PARTS, chat_template=template, add_generation_prompt=True)
        assert len(empty) < len(ours)


def test_a_template_that_loops_over_parts_gets_them(tokenizer) -> None:
    self = server(tokenizer, trusted=True)
    ours = chat_ids(self, messages=PARTS, chat_template=GEMMA3)
    assert ours == reference(tokenizer, PARTS, chat_template=GEMMA3, add_generation_prompt=True)
    # its own rendering of the parts (trimmed, no newline between them), not joined text
    assert ours != reference(tokenizer, JOINED, chat_template=GEMMA3, add_generation_prompt=True)


def test_template_variables_and_continuing_the_last_message(tokenizer) -> None:
    self = server(tokenizer, trusted=True)
    messages = [{"role": "user", "content": "hello there"}]
    thinking_off = chat_ids(
        self,
        messages=messages,
        chat_template=QWEN3,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert thinking_off == reference(
        tokenizer, messages, chat_template=QWEN3, add_generation_prompt=True, enable_thinking=False
    )
    assert thinking_off != chat_ids(self, messages=messages, chat_template=QWEN3)
    started = [*messages, {"role": "assistant", "content": "the cat"}]
    going_on = chat_ids(self, messages=started, continue_final_message=True)
    assert going_on == reference(tokenizer, started, continue_final_message=True)
    assert tokenizer.decode(going_on).endswith("the cat")  # no end of turn after it
    with pytest.raises(BadRequest, match="cannot both be true") as caught:
        chat_ids(self, messages=started, continue_final_message=True, add_generation_prompt=True)
    assert caught.value.param == "continue_final_message"
    with pytest.raises(BadRequest, match="may not set 'tokenize'") as caught:
        chat_ids(self, messages=messages, chat_template_kwargs={"tokenize": True})
    assert caught.value.param == "chat_template_kwargs"


def test_a_requests_template_needs_a_trusting_server_and_its_errors_are_400s(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match="--trust-request-chat-template") as caught:
        chat_ids(server(tokenizer), messages=messages, chat_template=QWEN3)
    assert caught.value.param == "chat_template"
    trusted = server(tokenizer, trusted=True)
    for broken in ("{% for m in messages %}{{ m.content", "{{ raise_exception('no users') }}"):
        with pytest.raises(TokenizerError, match="cannot render") as caught:
            chat_ids(trusted, messages=messages, chat_template=broken)
        assert caught.value.param == "messages"
