"""Prompt-lookup proposers: the continuation of the latest earlier occurrence of the request's
last n tokens (longest n first), found in its prediction, its own prompt and output, or the
recent outputs of all requests.

Every index is incremental: a step adds the n-grams of the tokens new since the last step and
does at most ``max_n`` dictionary lookups per source, so a batch's proposals cost microseconds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radixlm.runtime.request import Req
from radixlm.runtime.speculative.proposal import Proposal

MAX_NGRAM = 4  # longest n-gram looked up
RECENT_OUTPUT_TOKENS = 1 << 16  # tokens of finished outputs kept for cross-request lookup
RECENT_MIN_NGRAM = 2  # a single shared token says too little across requests


class NgramIndex:
    """n-gram (tuple) -> the position just after its latest occurrence, in one growing sequence.

    Only n-grams ending before ``upto`` are indexed (``extend``), so the sequence's own last
    tokens never match themselves.
    """

    def __init__(self, max_n: int = MAX_NGRAM) -> None:
        self.max_n = max_n
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the table

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams that end at positions ``indexed .. upto - 1``."""
        table, max_n = self.table, self.max_n
        for p in range(self.indexed, upto):
            for n in range(1, min(max_n, p + 1) + 1):
                table[tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self.indexed = max(self.indexed, upto)


def continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``tokens[start : start + k]`` as a list."""
    return list(tokens[start : start + k])


class _History:
    """One request's prompt + verified output and its n-gram index."""

    def __init__(self, req: Req, max_n: int) -> None:
        self.tokens = list(req.input_ids)
        self.prompt_len = len(req.input_ids)
        self.index = NgramIndex(max_n)

    def sync(self, req: Req) -> None:
        """Append the output tokens verified since the last step and index all but the last."""
        have = len(self.tokens) - self.prompt_len
        if have < len(req.output_ids):
            self.tokens.extend(req.output_ids[have:])
        self.index.extend(self.tokens, len(self.tokens) - 1)


class RecentOutputs:
    """A bounded, least-recently-used store of finished outputs with an n-gram index over them.

    Outputs are kept per ``cache_salt`` namespace (a salted request never sees another salt's
    text, as with the radix cache). Appending past ``max_tokens`` drops the least recently used
    outputs (a proposal from an output counts as a use) and their index entries.
    """

    def __init__(self, max_tokens: int = RECENT_OUTPUT_TOKENS, max_n: int = MAX_NGRAM, min_n: int = RECENT_MIN_NGRAM) -> None:
        self.max_tokens = max_tokens
        self.max_n = max_n
        self.min_n = min_n
        self.docs: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()
        self.table: dict[tuple, tuple[int, int]] = {}  # (salt, n-gram) -> (doc, position after it)
        self.size = 0
        self._next_id = 0

    def add(self, salt: str | None, tokens: Sequence[int]) -> None:
        """Remember one finished output."""
        tokens = list(tokens)
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        doc = self._next_id
        self._next_id += 1
        self.docs[doc] = (salt, tokens)
        self.size += len(tokens)
        for key, after in self._keys(salt, tokens):
            self.table[key] = (doc, after)
        while self.size > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        doc, (salt, tokens) = self.docs.popitem(last=False)
        self.size -= len(tokens)
        for key, _ in self._keys(salt, tokens):
            if self.table.get(key, (None,))[0] == doc:
                del self.table[key]

    def _keys(self, salt: str | None, tokens: list[int]):
        """Each indexed ``(salt, n-gram)`` key of an output and the position just after it."""
        for p in range(self.min_n - 1, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, p + 1) + 1):
                yield (salt, tuple(tokens[p - n + 1 : p + 1])), p + 1

    def lookup(self, salt: str | None, ngram: tuple[int, ...], k: int) -> list[int]:
        """What followed ``ngram`` in the latest output holding it (up to ``k`` tokens)."""
        hit = self.table.get((salt, ngram))
        if hit is None:
            return []
        doc, start = hit
        self.docs.move_to_end(doc)
        return continuation(self.docs[doc][1], start, k)


class NgramProposer:
    """Prompt lookup over the request's own prompt and output, then over recent outputs."""

    name = "ngram"

    def __init__(self, max_n: int = MAX_NGRAM, recent: RecentOutputs | None = None) -> None:
        self.max_n = max_n
        self.recent = recent if recent is not None else RecentOutputs(max_n=max_n)
        self._histories: dict[Req, _History] = {}

    def propose(self, reqs: list[Req], num_tokens: list[int], own_only: list[bool] | None = None) -> list[Proposal]:
        """For each row, the continuation of its longest matching recent n-gram (own text first).

        ``own_only[i]``: search only the request's own text (its proposals then depend on
        nothing but its own history, which keeps a seeded sample reproducible).
        """
        out = []
        for i, (req, k) in enumerate(zip(reqs, num_tokens)):
            hist = self._histories.get(req)
            if hist is None:
                hist = self._histories[req] = _History(req, self.max_n)
            hist.sync(req)
            out.append(Proposal(self._lookup(req, hist, k, bool(own_only and own_only[i]))))
        return out

    def _lookup(self, req: Req, hist: _History, k: int, own_only: bool) -> list[int]:
        tokens = hist.tokens
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), 0, -1):
            key = tuple(tokens[size - n :])
            start = hist.index.table.get(key)
            if start is not None:
                return continuation(tokens, start, k)
            if not own_only and n >= self.recent.min_n:
                found = self.recent.lookup(req.cache_salt, key, k)
                if found:
                    return found
        return []

    def release(self, req: Req) -> None:
        """Forget the request's index; a finished request's output joins the recent outputs."""
        self._histories.pop(req, None)
        if req.finish is not None and req.finish.status is None and req.output_ids:
            self.recent.add(req.cache_salt, req.output_ids)


class _Prediction:
    """One request's prediction tokens, their index, and how far the output has followed them."""

    def __init__(self, req: Req, max_n: int) -> None:
        self.tokens = list(req.prediction_ids)
        self.index = NgramIndex(max_n)
        self.index.extend(self.tokens, len(self.tokens))
        self.aligned = True  # the output so far equals the prediction's first tokens
        self.checked = 0  # output tokens compared with the prediction


class PredictionProposer:
    """Drafts from the client's predicted output (OpenAI ``prediction``).

    While the output follows the prediction from its start, the prediction's next tokens are
    proposed; after the output departs from it, the continuation of the longest n-gram (n >= 2)
    of the request's last tokens found in the prediction (the output may come back to it).
    """

    name = "prediction"

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = 2) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self._states: dict[Req, _Prediction] = {}

    def propose(self, reqs: list[Req], num_tokens: list[int]) -> list[Proposal]:
        """Prediction tokens for each row that has a prediction (empty proposals elsewhere)."""
        return [Proposal(self._one(req, k) if req.prediction_ids else []) for req, k in zip(reqs, num_tokens)]

    def _one(self, req: Req, k: int) -> list[int]:
        st = self._states.get(req)
        if st is None:
            st = self._states[req] = _Prediction(req, self.max_n)
        out = req.output_ids
        if st.aligned:
            end = min(len(out), len(st.tokens))
            if out[st.checked : end] != st.tokens[st.checked : end] or len(out) > len(st.tokens):
                st.aligned = False
            st.checked = end
        if st.aligned:
            return continuation(st.tokens, len(out), k)
        tail = last_tokens(req, self.max_n)
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            start = st.index.table.get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return continuation(st.tokens, start, k)
        return []

    def release(self, req: Req) -> None:
        """Forget the request's prediction state."""
        self._states.pop(req, None)


def last_tokens(req: Req, n: int) -> list[int]:
    """The request's last ``n`` tokens (prompt and verified output)."""
    out = req.output_ids
    if len(out) >= n:
        return list(out[len(out) - n :])
    return list(req.input_ids[max(len(req.input_ids) - (n - len(out)), 0) :]) + list(out)
