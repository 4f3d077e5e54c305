"""The grammar backend interface: compile a spec once, then one matcher per request.

A matcher follows one request's output token by token. Every backend fills the same int32
bitmask format (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed; EOS allowed only
where the grammar may end), so one batched mask-apply path serves all backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

SPEC_KINDS = ("regex", "json_schema", "ebnf")


class GrammarError(ValueError):
    """A spec that cannot be compiled or enforced (bad syntax, unsupported keyword, too large)."""


class Matcher(ABC):
    """One request's position in a compiled grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (state unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next step into ``bitmask[row]`` (int32, CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when nothing but end-of-sequence may follow."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def forced_text(self) -> str:
        """Text the grammar allows as the only continuation from here ('' when there is a choice)."""

    @abstractmethod
    def copy(self) -> Matcher:
        """An independent matcher in the same state."""

    def error(self) -> str | None:
        """Why the matcher can no longer be trusted (a backend limit was hit), or None."""
        return None

    def mask_needed(self) -> bool:
        """True when the next token must come from the mask even where the grammar would take
        another (the mask narrows the grammar; see budget.py): no lazy masking then."""
        return False

    def cut_short(self) -> bool:
        """True when the matcher narrowed the grammar to end the output early (see budget.py)."""
        return False


class CompiledGrammar(ABC):
    """A spec compiled against a vocabulary; immutable and shared through the cache."""

    warnings: tuple[str, ...] = ()  # what the grammar does not enforce (e.g. an unknown format)

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(ABC):
    """Compiles regex / JSON-schema / EBNF specs for one tokenizer."""

    name: str

    @abstractmethod
    def compile(self, kind: str, spec: str, timeout: float | None = None) -> CompiledGrammar:
        """Compile ``spec`` of ``kind``; raises GrammarError naming what is wrong.

        ``timeout`` (seconds) lets a backend that can stop a build (a worker process) stop it.
        """

    def close(self) -> None:
        """Release what the backend holds (worker processes); compiling afterwards may fail."""
        return None


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Turn a bool mask ``[..., W * 32]`` into int32 bitmask words ``[..., W]`` (``unpack_bitmask``'s inverse)."""
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64, device=allowed.device)
    return (allowed.view(*allowed.shape[:-1], -1, 32).to(torch.int64) * weights).sum(-1).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Turn an int32 bitmask ``[B, W]`` into a bool mask ``[B, vocab_size]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
