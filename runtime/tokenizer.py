"""Tokenizers: loading (HF folders, GGUF with an on-disk cache), end-of-turn ids, detokenizing."""

from __future__ import annotations

import logging
import os
from typing import Any

from radixlm.runtime.disk_cache import entry_for, write_entry
from radixlm.runtime.loader import is_gguf

logger = logging.getLogger(__name__)

# Tokens that end a turn or a document in common chat formats; they stop generation when present.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>", "<|eom_id|>")


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


def end_token_ids(tokenizer, config_eos: list[int]) -> set[int]:
    """Ids that end generation: the model's EOS ids plus end-of-turn tokens in the vocabulary."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_TOKENS if t in vocab)
    return ids


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """Render chat messages with the model's template into prompt text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, **kwargs)


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
