"""radixlm: a structured-generation runtime for LLM programs."""

from radixlm.runtime.engine import Engine
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]
