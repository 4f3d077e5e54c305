"""Model families by architecture name: which class runs a checkpoint.

A family class registers the architecture names that a checkpoint's ``config.json`` lists under
``architectures``, each with its model type (the name GGUF metadata gives, and
``ModelConfig.architecture`` holds)::

    @register_family(LlamaForCausalLM="llama", MistralForCausalLM="mistral")
    class LlamaForCausalLM(nn.Module): ...

Importing ``radixlm.runtime.models`` imports every family's file, which fills the registry.

Adding a family:

1. One new file in ``runtime/models/`` (``gemma.py``): an ``nn.Module`` with the surface of
   ``LlamaForCausalLM`` (built from ``(config, shard, group)``; ``forward(batch)``,
   ``compute_logits``, ``load_weights``, ``decode_stacks``), built from ``runtime/layers/``.
   Import it in ``runtime/models/__init__.py``.
2. Register its architecture names: ``@register_family(GemmaForCausalLM="gemma")`` on the class.
3. A new layer in ``runtime/layers/`` where it needs one no family has yet (a norm, an
   activation, soft-capping), with its PyTorch reference and its test.
4. A test against transformers: a tiny random checkpoint saved by transformers' own class (see
   ``tiny_model_dirs`` in ``tests/conftest.py``) gives the same greedy tokens here
   (``tests/test_parity.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

Family = TypeVar("Family", bound=type[nn.Module])

_MODEL_TYPES: dict[str, str] = {}  # architecture name -> model type
_FAMILIES: dict[str, type[nn.Module]] = {}  # model type -> family class


def register_family(**architectures: str) -> Callable[[Family], Family]:
    """Class decorator: the family runs checkpoints of these architecture names (each given its model type)."""

    def register(cls: Family) -> Family:
        for name, model_type in architectures.items():
            _MODEL_TYPES[name] = model_type
            _FAMILIES[model_type] = cls
        return cls

    return register


def supported_architectures() -> dict[str, str]:
    """Every registered architecture name and its model type."""
    return dict(_MODEL_TYPES)


def family_for(model_type: str) -> type[nn.Module]:
    """The family class that runs models of ``model_type`` (``ModelConfig.architecture``)."""
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model architecture {model_type!r}; radixlm runs {sorted(_MODEL_TYPES)}")
    return _FAMILIES[model_type]
