"""Attention backends: what adapts a ForwardBatch to the attention kernels."""
