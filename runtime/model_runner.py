"""ModelRunner: owns the model, the KV pool and the attention backend; runs ForwardBatches."""

from __future__ import annotations

import logging
import time

import torch

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.kv_quant import resolve_kv_format
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.loader import load_model
from radixlm.runtime.models.attention_backend import select_attention_backend
from radixlm.runtime.models.quant import quantize_model
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (host RAM available to new allocations on CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class ModelRunner:
    """Loads the model, sizes and owns the KV pool, and turns a ForwardBatch into logits."""

    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self.args = args
        self.device = torch.device(args.resolved_device())
        self.dtype = args.resolved_dtype(self.device)
        if self.device.type == "cpu":
            self._build_cpu_kernels()
        self.model, self.config = load_model(model_path, self.dtype, self.device)
        if args.quantization:
            quantize_model(self.model, args.quantization)
        elif self.dtype != torch.float32 and self.device.type == "cpu":
            self.model.keep_head_in_fp32()
        self.context_len = min(args.context_length or self.config.context_length, self.config.context_length)
        self.kv_format = resolve_kv_format(args.kv_cache_dtype, self.dtype)
        cfg = self.config
        self.kv_bytes_per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.kv_format)
        self.max_total_tokens = self._pool_size()
        self.kv_pool = KVPool(
            self.max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device, self.kv_format
        )
        self.attn_backend = select_attention_backend(args.attention_backend, self.device)
        logger.info(
            "KV pool: %d tokens of %s KV, %d bytes each (%.1f MiB), attention backend %s",
            self.max_total_tokens,
            self.kv_format.name,
            self.kv_bytes_per_token,
            self.kv_pool.nbytes() / 2**20,
            type(self.attn_backend).__name__,
        )

    @staticmethod
    def _build_cpu_kernels() -> None:
        """Compile (or find) the C++ CPU kernels now, so no request waits for the compiler."""
        t0 = time.perf_counter()
        ext = cpu_kernels()
        logger.info("C++ CPU kernels %s in %.1f s", "ready" if ext is not None else "unavailable", time.perf_counter() - t0)

    def _pool_size(self) -> int:
        page = self.args.page_size
        if self.args.max_total_tokens:
            n = self.args.max_total_tokens
        else:
            fraction = self.args.mem_fraction_static
            n = int(available_memory_bytes(self.device) * fraction // self.kv_bytes_per_token)
            n = min(n, 1 << 20)
        n -= n % page
        if n < page:
            raise ValueError(f"max_total_tokens {n} is smaller than one page ({page})")
        return n

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on the batch; returns fp32 logits of the rows in ``logits_indices``."""
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
