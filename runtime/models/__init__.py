"""Model code for the Llama family."""

from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig"]
