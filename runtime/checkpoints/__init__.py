"""Reading model checkpoints: their config, the tensors loaded as they are, and the quantized
weights kept in their stored format (GGUF blocks, AWQ/GPTQ int4, FP8), and putting those into a model."""

from radixlm.runtime.checkpoints.base import Checkpoint
from radixlm.runtime.checkpoints.open import open_checkpoint

__all__ = ["Checkpoint", "open_checkpoint"]
