"""Attention backends: what adapts a ForwardBatch to the attention kernels; importing this package registers them."""

from radixlm.kernels import triton_available
from radixlm.runtime.layers.attention.base import (
    AttentionBackend,
    register_attention_backend,
    register_unavailable_backend,
    select_attention_backend,
)
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend

if triton_available():

    @register_attention_backend("triton")
    def make_triton_backend() -> AttentionBackend:
        """The Triton backend. Its module is imported when it is first chosen, not here: importing
        triton takes a quarter second, and it must follow TRITON_INTERPRET as set before then."""
        from radixlm.runtime.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()

else:
    register_unavailable_backend("triton", "the triton package (pip install 'radixlm[triton]')")

__all__ = ["AttentionBackend", "TorchAttentionBackend", "register_attention_backend", "select_attention_backend"]
