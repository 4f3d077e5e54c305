"""Chat templates of the new families: Gemma's lack of a system role, Qwen3's thinking switch,
Gemma's end-of-turn token."""

from __future__ import annotations

import pytest

from helpers import make_tokenizer
from radixlm.runtime.tokenizer import END_TOKENS, apply_chat_template, end_token_ids

# Gemma 2's template, in short: no system role, turns between <start_of_turn> and <end_of_turn>.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Qwen3's thinking switch, in short: enable_thinking=false closes an empty think section.
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn(tokenizer):
    tokenizer.chat_template = GEMMA2_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = apply_chat_template(tokenizer, messages)
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_a_template_error_that_is_not_about_the_system_role_is_raised(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(Exception, match="alternate"):
        apply_chat_template(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}])


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tokenizer.chat_template = QWEN3_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]
    assert "<think>" not in apply_chat_template(tokenizer, messages)
    assert apply_chat_template(tokenizer, messages, template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        apply_chat_template(tokenizer, messages, template_kwargs={"add_generation_prompt": False})


def test_gemmas_end_of_turn_ends_generation(tokenizer):
    assert "<end_of_turn>" in END_TOKENS
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in end_token_ids(tokenizer, [])


def test_chat_template_kwargs_that_override_the_renderer_are_refused_by_name(tiny_client):
    r = tiny_client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400
    assert "chat_template_kwargs" in r.text, r.text
    r = tiny_client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200
