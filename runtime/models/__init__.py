"""Model families (one file each) and their registry, the config reader, the tensor-parallel split plan.

Importing this package imports every family, which registers its architecture names
(``radixlm.runtime.models.registry``).
"""

from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig"]
