"""Qwen3-Reranker's prompt: a (query, document) pair in the template its model card uses, and the
"yes"/"no" tokens whose last-position logits give the relevance P(yes).

The template (Qwen/Qwen3-Reranker-0.6B's model card, and vLLM's Qwen3-Reranker example)::

    <|im_start|>system
    Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>
    <|im_start|>user
    <Instruct>: {instruction}
    <Query>: {query}
    <Document>: {document}<|im_end|>
    <|im_start|>assistant
    <think>

    </think>

    (then the model's next token: "yes" or "no")

As in the model card, the prefix and suffix are tokenized without special tokens and the middle
part with the tokenizer's defaults, and the three id lists are joined.
"""

from __future__ import annotations

from typing import Any

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_text(query: str, document: str, instruction: str | None = None) -> str:
    """The middle part of the prompt: instruction, query and document."""
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def rerank_input_ids(tokenizer: Any, query: str, document: str, instruction: str | None = None) -> list[int]:
    """Token ids of the whole prompt for one (query, document) pair."""
    prefix = tokenizer(PREFIX, add_special_tokens=False).input_ids
    suffix = tokenizer(SUFFIX, add_special_tokens=False).input_ids
    return prefix + tokenizer(pair_text(query, document, instruction)).input_ids + suffix


def single_token_id(tokenizer: Any, word: str) -> int | None:
    """The id of ``word`` when the vocabulary holds it as one token, else None."""
    tid = tokenizer.convert_tokens_to_ids(word)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id:
        return tid
    ids = tokenizer(word, add_special_tokens=False).input_ids
    return ids[0] if len(ids) == 1 else None


def yes_no_ids(tokenizer: Any) -> tuple[int, int]:
    """The ("yes", "no") token ids (ValueError when the tokenizer lacks either as one token)."""
    yes, no = single_token_id(tokenizer, "yes"), single_token_id(tokenizer, "no")
    if yes is None or no is None:
        raise ValueError("this model's tokenizer has no single 'yes' and 'no' tokens: rerank and score need a Qwen3-Reranker-style model")
    return yes, no
