"""The Engine's LoRA controls: load and unload adapters at run time, list them.

Loading reads and checks the folder on the caller's thread (never stalling a step), then
registers the adapter on the loop thread. Unloading refuses the adapter to new requests at once
and returns once the requests already queued or running with it have finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixlm.runtime.lora.manager import LoraManager

UNLOAD_POLL_S = 0.02


class LoraControl:
    """Mixed into ``Engine`` (which provides ``runner``, ``scheduler`` and ``_call``)."""

    runner: Any
    scheduler: Any
    _call: Callable[[Callable[[], Any]], Any]

    def _lora(self) -> LoraManager:
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with lora_paths or enable_lora=True)")
        return self.runner.lora

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT adapter folder ``lora_path`` as ``lora_name`` (ValueError naming the bad file or field)."""
        lora = self._lora()
        if not isinstance(lora_name, str) or not lora_name or ":" in lora_name:
            raise ValueError(f"lora_name must be a non-empty string without ':', got {lora_name!r}")
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {lora_path!r}")
        if lora_name in lora.pool.names():
            raise ValueError(f"lora adapter {lora_name!r} is already loaded (unload it first)")
        adapter = lora.read(lora_name, lora_path)  # here, off the loop thread
        self._call(lambda: lora.pool.register(lora_name, lora_path, adapter, (r.lora for r in self.scheduler.running)))

    def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> bool:
        """Stop serving ``lora_name``: refused to new requests now; returns True once the requests
        queued or running with it have finished (False if ``timeout`` seconds passed first)."""
        lora = self._lora()
        self._call(lambda: lora.pool.unregister(lora_name))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if lora_name in self._call(lambda: lora.pool.sweep(r.lora for r in self.scheduler.waiting + self.scheduler.running)):
                return True
            if lora_name not in lora.pool.retired:  # swept by a concurrent call
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(UNLOAD_POLL_S)

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The served adapters: name, folder, rank, whether held in memory now."""
        if self.runner.lora is None:
            return []
        pool = self.runner.lora.pool

        def read() -> list[dict[str, Any]]:
            return [
                {"name": n, "path": pool.paths[n], "loaded": n in pool.loaded, "rank": pool.loaded[n].rank if n in pool.loaded else None}
                for n in pool.names()
            ]

        return self._call(read)
