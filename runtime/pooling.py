"""Pooling: what a request that returns a vector (or a relevance score) instead of tokens asks for,
how the model's pooling is chosen, and how the final hidden states become its answer.

A pooling request prefills its prompt and never samples (``max_new_tokens = 0``). Each forward
pass hands it the final hidden states (after the model's last norm) it asked for:

- ``last``: the last prompt position only. A cached prefix is not recomputed: the last position
  is always computed (the radix cache never serves it), and it attends to the cached KV.
- ``mean``: every prompt position, summed over the chunks of a chunked prefill. Cached KV holds
  keys and values, not hidden states, so a mean-pooled request reads nothing from the cache (it
  recomputes its whole prompt); its KV still goes to the tree for the requests after it.
- ``score``: the last position's logits of two tokens (Qwen3-Reranker's "yes" and "no"): the
  answer is P(yes) of a softmax over the two.

Embeddings are L2-normalised; ``dimensions`` keeps the first ``d`` of them and renormalises
(Matryoshka), where the model allows it (``PoolingConfig.matryoshka``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "mean")


@dataclass
class PoolingTask:
    """What one pooling request returns, and what it has gathered so far."""

    mode: str  # "last", "mean" or "score"
    score_ids: tuple[int, int] | None = None  # ("yes", "no") token ids, for "score"
    total: torch.Tensor | None = None  # float32 [hidden]: the running sum (mean) or the last state
    count: int = 0  # positions summed into ``total``
    result: list[float] | None = None  # the normalised vector, or [P(yes)] for "score"

    @property
    def reads_cache(self) -> bool:
        """True when a cached prefix may stand in for computing it (not for mean pooling)."""
        return self.mode != "mean"


@dataclass(frozen=True)
class PoolingConfig:
    """The served model's pooling: the mode, where it came from, and the Matryoshka sizes it allows."""

    mode: str = "last"
    source: str = "default"  # "flag", a file of the model folder, or "default"
    matryoshka: frozenset[int] | None = None  # dimensions allowed; None: none; empty: any size up to hidden
    hidden_size: int = 0

    def check_dimensions(self, dims: int | None) -> None:
        """Raise ValueError (naming ``dimensions``) when ``dims`` is not a size this model gives."""
        if dims is None:
            return
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dims!r}")
        if dims > self.hidden_size:
            raise ValueError(f"dimensions: {dims} is larger than the model's hidden size ({self.hidden_size})")
        if self.matryoshka is None:
            raise ValueError("dimensions: this model does not allow shortened embeddings (start the server with --matryoshka-dims, or set is_matryoshka / matryoshka_dimensions in config.json)")
        if self.matryoshka and dims not in self.matryoshka and dims != self.hidden_size:
            raise ValueError(f"dimensions: {dims} is not one of the model's sizes {sorted(self.matryoshka)}")


def _read_json(path: str) -> dict | list | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sentence_transformers_mode(folder: str) -> tuple[str | None, str]:
    """The pooling a sentence-transformers folder declares (``modules.json`` → its Pooling module's
    ``config.json``): ``last``, ``mean``, another mode's name, or None when it declares none."""
    modules = _read_json(os.path.join(folder, "modules.json"))
    path = "1_Pooling"
    if isinstance(modules, list):
        found = [m.get("path") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")]
        if found and isinstance(found[0], str):
            path = found[0]
    where = os.path.join(path, "config.json")
    cfg = _read_json(os.path.join(folder, where))
    if not isinstance(cfg, dict):
        return None, where
    if cfg.get("pooling_mode_lasttoken"):
        return "last", where
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean", where
    other = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    return (other[0] if other else None), where


def _matryoshka(folder: str, flag: str | None) -> frozenset[int] | None:
    """Dimensions allowed: from ``--matryoshka-dims`` ("any" or "32,64,..."), else config.json's
    ``matryoshka_dimensions`` / ``is_matryoshka`` (vLLM's names); None when neither allows it."""
    if flag is not None:
        if flag.strip().lower() == "any":
            return frozenset()
        return frozenset(int(x) for x in flag.split(",") if x.strip())
    cfg = _read_json(os.path.join(folder, "config.json"))
    if not isinstance(cfg, dict):
        return None
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return frozenset(dims)
    return frozenset() if cfg.get("is_matryoshka") is True else None


def load_pooling_config(model_path: str, hidden_size: int, flag: str | None = None, matryoshka_flag: str | None = None) -> PoolingConfig:
    """The pooling of the model at ``model_path``: ``flag`` (``--pooling``) when given, else what its
    sentence-transformers files say, else last-token pooling."""
    folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    dims = _matryoshka(folder, matryoshka_flag)
    cfg = _read_json(os.path.join(folder, "config.json"))
    if isinstance(cfg, dict) and cfg.get("is_causal") is False:
        logger.warning("config.json says is_causal: false (trained with bidirectional attention); radixlm attends causally, so its embeddings will differ from the reference")
    if flag is not None:
        return PoolingConfig(flag, "flag", dims, hidden_size)
    mode, where = _sentence_transformers_mode(folder)
    if mode in POOLING_MODES:
        return PoolingConfig(mode, where, dims, hidden_size)
    if mode is not None:
        logger.warning("%s asks for %s pooling, which radixlm does not run: pooling the last token (--pooling sets it)", where, mode)
    return PoolingConfig("last", "default", dims, hidden_size)


# ---------------------------------------------------------------------------- the math
def normalize(vec: torch.Tensor, dims: int | None = None) -> list[float]:
    """``vec`` (float32) cut to its first ``dims`` entries, then L2-normalised, as a list."""
    v = vec[:dims] if dims is not None else vec
    return torch.nn.functional.normalize(v.float(), dim=-1).tolist()


def gather(task: PoolingTask, hidden: torch.Tensor, first: bool) -> None:
    """Add one row's hidden states ``[n, hidden]`` (all its positions for mean, its last for last);
    ``first``: the row starts the prompt (a retracted request restarts its sum)."""
    h = hidden.float()
    if task.mode == "last":
        task.total = h[-1].clone()
        task.count = 1
        return
    if first or task.total is None:
        task.total, task.count = torch.zeros(h.shape[-1], dtype=torch.float32, device=h.device), 0
    task.total += h.sum(0)
    task.count += h.shape[0]


def finish(task: PoolingTask, logits: torch.Tensor | None) -> None:
    """Turn what was gathered into the answer: the normalised vector, or [P(yes)] from the last
    position's ``logits`` for a score."""
    if task.mode == "score":
        yes, no = task.score_ids
        vec = logits.float()[[yes, no]]
    else:
        vec = task.total / max(task.count, 1) if task.mode == "mean" else task.total
    if not bool(torch.isfinite(vec).all()):
        raise ValueError("the model's outputs are not finite")
    task.result = [float(torch.softmax(vec, dim=-1)[0])] if task.mode == "score" else normalize(vec.cpu())
