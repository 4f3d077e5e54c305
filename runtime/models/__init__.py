"""Model families (one file each) and their registry, the config reader, the tensor-parallel split plan.

Importing this package imports every family, which registers its architecture names
(``radixlm.runtime.models.registry``).
"""

from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.deepseek import DeepseekForCausalLM
from radixlm.runtime.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from radixlm.runtime.models.gpt_oss import GptOssForCausalLM
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.mixtral import MixtralForCausalLM
from radixlm.runtime.models.phi3 import Phi3ForCausalLM
from radixlm.runtime.models.qwen3 import Qwen3ForCausalLM
from radixlm.runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from radixlm.runtime.models.qwen3_next import Qwen3NextForCausalLM

__all__ = [
    "DeepseekForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "ModelConfig",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
]
