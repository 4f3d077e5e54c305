"""The request → token-slot table: one row per running request, one column per position."""

from __future__ import annotations

import torch


class ReqToTokenTable:
    """Rows of KV slot indices: ``table[row, pos]`` is the slot holding token ``pos``'s KV."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if max_requests <= 0 or max_context_len <= 0:
            raise ValueError("max_requests and max_context_len must be positive")
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def available(self) -> int:
        """Rows that can be handed out."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take a free row, or None when every row is in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Give a row back."""
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions ``start .. start + len(slots)`` of ``row`` live at ``slots``."""
        self.table[row, start : start + len(slots)] = slots

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """The slots of positions ``start .. end`` of ``row``."""
        return self.table[row, start:end]
