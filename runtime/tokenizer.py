"""Tokenizers: loading (HF folders, GGUF with an on-disk cache), end-of-turn ids, detokenizing."""

from __future__ import annotations

import logging
import os
from typing import Any

from radixlm.runtime.disk_cache import entry_for, write_entry
from radixlm.runtime.loader import is_gguf

logger = logging.getLogger(__name__)

# Tokens that end a turn or a document in common chat formats; they stop generation when present.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>", "<|eom_id|>", "<end_of_turn>")
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "tokenize", "add_generation_prompt", "return_dict", "chat_template")


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """A Hugging Face fast tokenizer for the model (from a folder, or converted from GGUF once)."""
    from transformers import AutoTokenizer

    source = tokenizer_path or model_path
    if not is_gguf(source):
        return AutoTokenizer.from_pretrained(source)
    cached = entry_for(source, "tokenizer")
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, exc)
    folder, name = os.path.split(os.path.abspath(source))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not write_entry(cached, lambda tmp: tok.save_pretrained(str(tmp))):
        logger.warning("could not cache the tokenizer in %s", cached)
    return tok


HARMONY_END_TOKENS = ("<|return|>", "<|call|>")  # GPT-OSS: the turn is over, or a tool call waits


def end_token_ids(tokenizer, config_eos: list[int]) -> set[int]:
    """Ids that end generation: the model's EOS ids plus end-of-turn tokens in the vocabulary.

    In a harmony vocabulary (GPT-OSS: ``<|channel|>`` and ``<|return|>``) ``<|end|>`` closes one
    message of a turn (the reasoning, say) and is not one of them; ``<|return|>`` and ``<|call|>`` are."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    harmony = "<|channel|>" in vocab and "<|return|>" in vocab
    ends = [t for t in END_TOKENS if not (harmony and t == "<|end|>")] + (list(HARMONY_END_TOKENS) if harmony else [])
    ids.update(vocab[t] for t in ends if t in vocab)
    if harmony and "<|end|>" in vocab and vocab["<|end|>"] != tokenizer.eos_token_id:
        ids.discard(vocab["<|end|>"])
    return ids


def apply_chat_template(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None, add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """Render chat messages with the model's template into prompt text.

    ``template_kwargs`` are extra variables for the template (Qwen3's ``enable_thinking``). A
    template without a system role (Gemma 2's refuses one) gets the system text at the start of
    the first user turn, as Gemma 3's own template places it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    reserved = sorted(set(template_kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:
        folded = _system_folded(messages)
        if folded is None or "system" not in str(exc).lower():
            raise
        return tokenizer.apply_chat_template(folded, **kwargs)


def _system_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with leading system messages moved into the first user turn (None: no system message to move)."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system or not rest or rest[0].get("role") != "user" or not all(isinstance(m.get("content"), str) for m in system):
        return None
    preamble = "\n\n".join(m["content"] for m in system)
    first = rest[0]
    content = first.get("content")
    if isinstance(content, str):
        merged = f"{preamble}\n\n{content}"
    else:  # content parts
        merged = [{"type": "text", "text": preamble + "\n\n"}, *(content or [])]
    return [{**first, "content": merged}, *rest[1:]]


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without re-decoding everything.

    A few prompt tokens are kept as left context so tokenizers that drop a word's leading space
    when decoding it alone (SentencePiece) still produce the right text. Text ending in an
    incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # Fast (Rust) tokenizers ignore this (measured: the same text either way); slow ones may not.
        self.spaces_between_special = spaces_between_special_tokens
        self.context = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, spaces_between_special_tokens=self.spaces_between_special)

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """Append the text of new ids (``output_ids`` is the whole output so far); returns the delta.

        Only the ids from ``prefix_offset`` on are decoded, and the output list is never copied
        whole, so each call costs time in proportion to the new tokens.
        """
        total = len(self.context) + len(output_ids)
        if total <= self.read_offset:
            return ""
        window = self._window(output_ids, self.prefix_offset, total)
        split = self.read_offset - self.prefix_offset
        before = self._decode(window[:split])
        after = self._decode(window)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            delta = after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, total
            self.text += delta
            return delta
        return ""

    def _window(self, output_ids: list[int], lo: int, hi: int) -> list[int]:
        """Ids ``lo:hi`` of the sequence context + output, without building that sequence."""
        c = len(self.context)
        if lo >= c:
            return output_ids[lo - c : hi - c]
        return self.context[lo:] + output_ids[: hi - c]
