"""The record of an opened checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.layers.stored_weight import StoredWeight
from radixlm.runtime.models.config import ModelConfig

TensorSource = Callable[[], Iterator[tuple[str, Any]]]


@dataclass
class Checkpoint:
    """A model file or folder opened for loading.

    ``plain()`` yields ``(Hugging Face name, tensor or lazy safetensors slice)`` for the tensors
    the model copies into its parameters; ``stored`` holds, by the Hugging Face name a dense
    checkpoint would give them, the weights kept in their stored format."""

    config: ModelConfig
    plain: TensorSource
    stored: dict[str, StoredWeight] = field(default_factory=dict)
    file_bytes: int = 0

    @property
    def formats(self) -> set[str]:
        """The stored formats present (``gguf:Q4_K``, ``gptq`` ...); empty for a dense checkpoint."""
        return {w.format for w in self.stored.values()}
