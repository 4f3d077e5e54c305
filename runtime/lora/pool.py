"""The adapters an engine knows (name -> folder) and those it holds in memory, with LRU eviction.

An adapter is *registered* (``--lora-paths``, ``POST /load_lora_adapter``) and, while requests
use it, *loaded*. At most ``max_loaded`` adapters are held; loading one more evicts the least
recently used adapter that no running request uses (it is read again from its folder when a
request next asks for it). Unloading (``unregister``) refuses it to new requests at once; the
requests already queued or running with it finish with it, and ``sweep`` forgets it after them. A step's batch holds rows of at most ``max_per_batch`` distinct
adapters: admission checks that with ``admits``. Every method runs on the engine's loop thread,
and the name lookups of request intake (``cache_key``, ``names``) share a lock with them.

Which adapters are in use is never counted by hand: it is the set of adapters of the running
requests, which the scheduler passes in (``in_use``), so no exit path can leak a reference.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from radixlm.runtime.lora.adapter import LoraAdapter


class LoraPool:
    """Registered adapters by name, the loaded ones in LRU order, and the per-batch bound."""

    def __init__(self, load: Callable[[str, str], LoraAdapter], max_loaded: int | None = None, max_per_batch: int = 8) -> None:
        self._load = load  # (name, path) -> LoraAdapter, checked against the base model
        self.max_loaded = max_loaded
        self.max_per_batch = max_per_batch
        self.paths: dict[str, str] = {}
        self.generation: dict[str, int] = {}  # bumped at each registration: keys the radix cache
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.retired: set[str] = set()  # unloaded: refused to new requests, kept for those still queued or running
        self._registrations = 0
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from their folders (tests, stats)
        self.evictions = 0

    def register(self, name: str, path: str, adapter: LoraAdapter | None = None, in_use: Iterable[str | None] = ()) -> None:
        """Know adapter ``name`` at ``path``; ``adapter`` (already read) is held now if room can be
        made beside the running ``in_use`` adapters. ValueError if the name is taken."""
        with self._lock:
            if name in self.paths:
                still = " (it is still unloading: requests use it)" if name in self.retired else ""
                raise ValueError(f"lora adapter {name!r} is already loaded{still}")
            self._registrations += 1
            self.paths[name] = path
            self.generation[name] = self._registrations
        if adapter is not None and self._make_room({n for n in in_use if n is not None}):
            self.loaded[name] = adapter

    def unregister(self, name: str) -> None:
        """Refuse ``name`` to new requests; those queued or running keep it until ``sweep``. ValueError if unknown."""
        with self._lock:
            if name not in self.paths or name in self.retired:
                raise ValueError(f"lora adapter {name!r} is not loaded")
            self.retired.add(name)

    def cache_key(self, name: str) -> str:
        """What the radix cache keys ``name``'s KV by (a reloaded adapter never hits its old KV); ValueError if unknown."""
        with self._lock:
            if name not in self.paths or name in self.retired:
                raise ValueError(f"lora: unknown adapter {name!r}; loaded: {self._names()}")
            return f"lora:{name}#{self.generation[name]}"

    def names(self) -> list[str]:
        """The registered adapters' names."""
        with self._lock:
            return self._names()

    def _names(self) -> list[str]:
        return sorted(set(self.paths) - self.retired)

    def admits(self, name: str | None, in_use: Iterable[str | None]) -> bool:
        """True when a request of adapter ``name`` may join the running ``in_use`` adapters now,
        loading the adapter if needed; False: it waits (the batch has ``max_per_batch`` adapters,
        or every loaded one is in use). ValueError when ``name`` was unloaded meanwhile."""
        if name is None:
            return True
        active = {n for n in in_use if n is not None}
        if name not in active and len(active) >= self.max_per_batch:
            return False
        return self.acquire(name, active) is not None

    def acquire(self, name: str, in_use: set[str]) -> LoraAdapter | None:
        """The loaded adapter ``name`` (read from its folder, evicting an unused one, if needed);
        None when every loaded adapter is in use. ValueError when ``name`` is not registered."""
        with self._lock:
            path = self.paths.get(name)
        if path is None:
            raise ValueError(f"lora adapter {name!r} is not loaded")
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name]
        if not self._make_room(in_use):
            return None
        adapter = self._load(name, path)
        self.loads += 1
        self.loaded[name] = adapter
        return adapter

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter of a running request."""
        return self.loaded[name]

    def sweep(self, in_use: Iterable[str | None]) -> list[str]:
        """Forget the unloaded adapters no request in ``in_use`` (queued or running) still uses; returns their names."""
        active = set(in_use)
        with self._lock:
            gone = [n for n in self.retired if n not in active]
            for n in gone:
                self.retired.discard(n)
                del self.paths[n]
                self.loaded.pop(n, None)
        return gone

    def _make_room(self, in_use: set[str]) -> bool:
        """Evict least recently used adapters no running request uses until one more fits."""
        while self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            victim = next((n for n in self.loaded if n not in in_use), None)
            if victim is None:
                return False
            del self.loaded[victim]
            self.evictions += 1
        return True
