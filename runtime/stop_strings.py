"""Stop strings: an Aho-Corasick automaton over a request's stops, fed only the new text each step.

The automaton is built once per request, where its sampling parameters are validated (the HTTP
handler's thread, not the engine loop). Each step then feeds it the characters the step added,
from the state the previous step left, so the check costs time in proportion to the new text
whatever the number or length of the stops:

- a match is a stop that ends in the new text; of several, the one that starts first wins, and
  of those the one listed first (the order a scan of the list gives);
- the hold is the longest end of the text that is the start of a stop, but not a whole one: a
  stream keeps it back until the next step shows whether the stop completes.

A request whose stop was found but who had to go on (``min_new_tokens``) keeps feeding the same
state; its next match must end in text added after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class StopStrings:
    """The automaton of one list of stop strings (immutable; share it between requests)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        depth = [0]
        ends: list[int] = [-1]  # index of the first stop that ends exactly at the node, or -1
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._fail.append(0)
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                node = nxt
            if ends[node] < 0:
                ends[node] = index
        # Per node: the longest stop that ends there (length, index), and the hold.
        self._out: list[tuple[int, int] | None] = [None] * len(self._goto)
        self._hold = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        for node in queue:
            self._settle(node, depth, ends)
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                link = self._fail[node]
                while link and ch not in self._goto[link]:
                    link = self._fail[link]
                self._fail[child] = self._goto[link].get(ch, 0)
                self._settle(child, depth, ends)
                queue.append(child)

    def _settle(self, node: int, depth: list[int], ends: list[int]) -> None:
        """Fill ``_out`` and ``_hold`` of ``node`` (its failure link's are already filled)."""
        link = self._fail[node]
        self._out[node] = (depth[node], ends[node]) if ends[node] >= 0 else self._out[link]
        self._hold[node] = depth[node] if self._goto[node] else self._hold[link]

    def feed(self, state: int, text: str, start: int = 0) -> tuple[int, tuple[int, int, int] | None]:
        """Consume ``text[start:]`` from ``state``; returns the new state and the earliest match
        ``(start, end, stop index)`` that ends in the consumed part (positions index ``text``)."""
        goto, fail, out = self._goto, self._fail, self._out
        best: tuple[int, int, int] | None = None
        node = state
        for pos in range(start, len(text)):
            ch = text[pos]
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            found = out[node]
            if found is not None:
                length, index = found
                hit = (pos + 1 - length, pos + 1, index)
                if best is None or (hit[0], hit[2]) < (best[0], best[2]):
                    best = hit
        return node, best

    def hold(self, state: int) -> int:
        """How many characters at the end of the consumed text might begin a stop (not a whole one)."""
        return self._hold[state]


@dataclass
class StopScan:
    """One request's place in its stop automaton: the state and how much text it has consumed."""

    automaton: StopStrings
    state: int = 0
    consumed: int = 0

    def update(self, text: str) -> tuple[int, int, str] | None:
        """Feed what ``text`` (the request's whole text, only ever grown) added since the last
        call; returns the earliest stop ``(start, end, stop)`` that ends in it, if any."""
        if self.consumed > len(text):  # the text was rebuilt shorter: start over
            self.state = self.consumed = 0
        self.state, found = self.automaton.feed(self.state, text, self.consumed)
        self.consumed = len(text)
        if found is None:
            return None
        start, end, index = found
        return start, end, self.automaton.stops[index]

    def hold(self) -> int:
        """Characters at the end of the text that a stream must keep back for now."""
        return self.automaton.hold(self.state)
