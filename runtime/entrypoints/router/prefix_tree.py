"""An approximate radix tree over request text, shared by the workers with per-worker tenancy.

The router cannot see a worker's KV cache; it guesses it from the text it sent there. Each node
holds an edge label and, per worker (tenant) whose text ran through the whole edge, the tick of
that worker's last use. A worker holds a node only if it holds the node's parent, and its tick
on a parent is never older than on a child, so a worker's least-recently-used leaf is always
the part of its text that is safe to forget first::

    root ── "You are a helpful" {A:7, B:9} ─┬─ " bot. Hi" {A:7}
                                            └─ " cat. Yo" {B:9}

``match("You are a helpful cat")`` walks as far as the text goes: B holds 21 characters, A 17.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    """One edge of the tree: its label, children by first character, and its tenants' ticks."""

    key: str = ""
    parent: _Node | None = None
    children: dict[str, _Node] = field(default_factory=dict)
    tenants: dict[str, int] = field(default_factory=dict)


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Which worker last saw the longest prefix of a text; at most ``max_tree_chars`` per worker."""

    def __init__(self, max_tree_chars: int) -> None:
        if max_tree_chars <= 0:
            raise ValueError(f"max_tree_chars must be positive, got {max_tree_chars}")
        self.max_tree_chars = max_tree_chars
        self._root = _Node()
        self._sizes: dict[str, int] = {}
        self._tick = 0

    def size(self, worker: str) -> int:
        """Characters of text the tree holds for ``worker``."""
        return self._sizes.get(worker, 0)

    def insert(self, text: str, worker: str) -> None:
        """Record that ``worker`` saw ``text`` (its first ``max_tree_chars`` characters); past the
        bound, evict down to 7/8 of it (so the walk that finds the leaves is paid rarely)."""
        text = text[: self.max_tree_chars]
        self._tick += 1
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
            shared = _common_len(child.key, text[pos:])
            if shared < len(child.key):
                child = self._split(child, shared)
            if worker not in child.tenants:
                self._sizes[worker] = self._sizes.get(worker, 0) + len(child.key)
            child.tenants[worker] = self._tick
            node, pos = child, pos + shared
        if self.size(worker) > self.max_tree_chars:
            self.evict(worker, self.max_tree_chars - self.max_tree_chars // 8)

    def match(self, text: str, workers: Collection[str] | None = None) -> tuple[str | None, int]:
        """``(worker, characters)``: the worker (of ``workers``, default all) holding the longest
        prefix of ``text``, the most recently used on a tie; ``(None, 0)`` when none holds any."""
        holders, matched = self.holders(text, workers)
        return (holders[0] if holders else None), matched

    def holders(self, text: str, workers: Collection[str] | None = None) -> tuple[list[str], int]:
        """``(workers, characters)``: every worker (of ``workers``, default all) holding the
        longest prefix of ``text``, most recently used first; ``([], 0)`` when none holds any."""
        allowed = (lambda w: True) if workers is None else set(workers).__contains__
        best: tuple[list[str], int] = ([], 0)
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            shared = _common_len(child.key, text[pos:])
            holders = sorted(((tick, w) for w, tick in child.tenants.items() if allowed(w)), reverse=True)
            if not holders:
                break  # a parent holds every tenant of its children: none deeper either
            best = ([w for _, w in holders], pos + shared)
            if shared < len(child.key):
                break
            node, pos = child, pos + shared
        return best

    def evict(self, worker: str, target: int) -> None:
        """Forget ``worker``'s least-recently-used leaves until it holds at most ``target`` characters."""
        heap = [(n.tenants[worker], id(n), n) for n in self._held(worker) if not self._holds_a_child(n, worker)]
        heapq.heapify(heap)
        while heap and self.size(worker) > target:
            _, _, node = heapq.heappop(heap)
            parent = self._drop(node, worker)
            if parent is not self._root and not self._holds_a_child(parent, worker):
                heapq.heappush(heap, (parent.tenants[worker], id(parent), parent))

    def remove_worker(self, worker: str) -> None:
        """Forget everything ``worker`` holds (its cache was flushed, or it left)."""
        self.evict(worker, 0)
        self._sizes.pop(worker, None)

    def check_integrity(self) -> None:
        """Assert the structure: labels, parent links, tenancy closed under parents, ticks, sizes."""
        sizes: dict[str, int] = {}
        stack = [self._root]
        assert not self._root.key and not self._root.tenants and self._root.parent is None
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, f"child {child.key!r} filed under {first!r}"
                assert child.parent is node, "a child's parent link is wrong"
                assert child.tenants, f"node {child.key!r} has no tenant (it should have been removed)"
                for w, tick in child.tenants.items():
                    if node is not self._root:
                        assert w in node.tenants, f"{w} holds {child.key!r} but not its parent"
                        assert node.tenants[w] >= tick, f"{w}'s tick on a parent is older than on its child"
                    sizes[w] = sizes.get(w, 0) + len(child.key)
                stack.append(child)
        held = {w: s for w, s in self._sizes.items() if s}
        assert sizes == held, f"sizes {held} but the nodes hold {sizes}"
        for w, s in sizes.items():
            assert s <= self.max_tree_chars, f"{w} holds {s} characters, over {self.max_tree_chars}"

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s label at ``at``; returns the new upper node (same tenants)."""
        upper = _Node(node.key[:at], node.parent, {}, dict(node.tenants))
        assert node.parent is not None
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _drop(self, node: _Node, worker: str) -> _Node:
        """Remove ``worker`` from a node it holds as a leaf (the node too if it has no tenant left)."""
        del node.tenants[worker]
        self._sizes[worker] -= len(node.key)
        parent = node.parent
        assert parent is not None
        if not node.tenants:
            del parent.children[node.key[0]]
            node.parent = None
        return parent

    def _held(self, worker: str) -> list[_Node]:
        """Every node ``worker`` holds (a subtree hanging from the root)."""
        out, stack = [], [c for c in self._root.children.values() if worker in c.tenants]
        while stack:
            node = stack.pop()
            out.append(node)
            stack += [c for c in node.children.values() if worker in c.tenants]
        return out

    @staticmethod
    def _holds_a_child(node: _Node, worker: str) -> bool:
        return any(worker in c.tenants for c in node.children.values())
