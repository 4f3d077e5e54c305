"""ModelRunner: owns the model, the KV pool and the attention backend; runs ForwardBatches.

Under tensor parallelism (``tp_size > 1``) every rank has a ModelRunner over its shard. Rank 0's
(the engine's) also starts the workers, through the ``StartTP`` the engine's assembly gives it,
and, each step, broadcasts the batch plan before running its own shard; all ranks then gather the
vocabulary slices of the logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.kv_quant import resolve_kv_format
from radixlm.radix_cache.pool import KVPool
from radixlm.radix_cache.state_journal import StateJournal
from radixlm.radix_cache.state_pool import StatePool
from radixlm.radix_cache.state_snapshots import StateSnapshots
from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.executor.batch_plan import send_batch
from radixlm.runtime.executor.decode_graphs import DecodeGraphs
from radixlm.runtime.executor.tensor_parallel import StartTP, TensorParallel, TensorParallelError
from radixlm.runtime.layers.attention import select_attention_backend
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.moe import MoEBlock
from radixlm.runtime.layers.quant import quantize_model
from radixlm.runtime.loader import (
    load_model,
    load_model_config,
    prepare_weights,
    serve_as_stored,
    stored_formats,
    weight_bytes,
)
from radixlm.runtime.lora.manager import LoraManager
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.sharding import TPShard, linear_spec, plan_shard
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.threads import configure_threads

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
    """Loads the model, sizes and owns the KV pool, and turns a ForwardBatch into logits.

    ``group`` and ``pool_tokens`` are given to the runners of tensor-parallel workers; the
    engine's runner starts the workers and joins their group with ``start_tp`` (the driver the
    engine's assembly passes in) when ``args.tp_size > 1``.
    """

    def __init__(self, args: ServerArgs, model_path: str, group: TPGroup | None = None, pool_tokens: int | None = None, start_tp: StartTP | None = None) -> None:
        if args.tp_size > 1 and group is None and start_tp is None:
            raise ValueError("tp_size > 1 needs start_tp, the tensor-parallel driver that starts the workers")
        self.args = args
        self.device = torch.device(args.resolved_device()) if group is None else group.device
        if self.device.type == "cuda" and args.tp_size > 1 and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.dtype = args.resolved_dtype(self.device)
        self.driver: TensorParallel | None = None
        self.group = group
        self.reserved_bytes = 0  # memory the KV pool leaves to other per-request state (a hybrid model's state pool)
        self.state_snapshots: StateSnapshots | None = None
        self.state_journal: StateJournal | None = None  # rank 0 of a hybrid model's group: the state decisions the workers repeat
        if self.device.type == "cpu" and group is None:
            self._build_cpu_kernels()  # before any worker starts, which then finds them built
        if args.tp_size > 1 and group is None:
            pool_tokens = self._start_workers(model_path, start_tp)
            self.group = self.driver.group
        try:
            self._load(model_path, pool_tokens)
            if self.driver is not None:
                self.driver.wait_ready()
        except BaseException:
            self.close()
            raise

    def _start_workers(self, model_path: str, start_tp: StartTP) -> int:
        """Plan the pool from the config, start the workers, join the group; returns the pool size."""
        cfg = load_model_config(model_path)
        size = self.args.tp_size
        shards = [plan_shard(cfg, r, size) for r in range(size)]  # a model that cannot split is refused here
        kv_format = resolve_kv_format(self.args.kv_cache_dtype, self.dtype)
        layouts = [cfg.kv_layout(s.num_kv_heads) for s in shards]  # (kv heads, width, latent width) of each rank's pool
        per_rank = [KVPool.bytes_per_token(cfg.kv_layers, heads, dim, self.dtype, kv_format, latent) for heads, dim, latent in layouts]
        self._plan_states(cfg, shards)  # before the workers start: they size their state pools from the same args
        # CPU ranks share the host's memory; each GPU rank has its own device
        pool_tokens = self._pool_size(sum(per_rank) if self.device.type == "cpu" else max(per_rank))
        prepare_weights(model_path)
        threads = configure_threads(self.args.num_threads, share=size)
        self.driver = start_tp(self.args, model_path, pool_tokens, threads, self.device)
        return pool_tokens

    def _load(self, model_path: str, pool_tokens: int | None) -> None:
        args = self.args
        self.weight_formats = stored_formats(model_path)
        # tensor-parallel ranks split dense weights: a stored checkpoint is dequantized for them
        native = self.group is None and serve_as_stored(self.weight_formats, args.quantization)
        self.model, self.config = load_model(model_path, self.dtype, self.device, self.group, native=native)
        shard = self.shard = self.model.shard
        if args.quantization not in (None, "none") and not (native and self.weight_formats):
            quantize_model(self.model, args.quantization)
        elif self.dtype != torch.float32 and self.device.type == "cpu":
            self.model.keep_head_in_fp32()
        if any([m.stack_experts() for m in self.model.modules() if isinstance(m, MoEBlock)]) and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the experts' unstacked copies, before the KV pool is sized from the free memory
        self.weight_bytes = weight_bytes(self.model)
        logger.info("weights: %.1f MiB in memory%s", self.weight_bytes / 2**20, f" ({', '.join(sorted(self.weight_formats))} as stored)" if native and self.weight_formats else "")
        self.model.decode_stacks.enabled = not args.disable_decode_stack
        self.context_len = min(args.context_length or self.config.context_length, self.config.context_length)
        self.kv_format = resolve_kv_format(args.kv_cache_dtype, self.dtype)
        cfg = self.config
        kv_heads, kv_dim, latent_dim = cfg.kv_layout(None if shard is None else shard.num_kv_heads)  # MLA: one latent row a layer
        self.kv_bytes_per_token = KVPool.bytes_per_token(cfg.kv_layers, kv_heads, kv_dim, self.dtype, self.kv_format, latent_dim)
        self.state_pool = self._state_pool()
        self.max_total_tokens = pool_tokens or self._pool_size(self.kv_bytes_per_token)
        # one slot past the allocator's, owned by no request: the padded rows of captured decode steps write there
        self.pad_write_slot = self.max_total_tokens
        self.kv_pool = KVPool(self.max_total_tokens + 1, cfg.kv_layers, kv_heads, kv_dim, self.dtype, self.device, self.kv_format, latent_dim)
        self.attn_backend = select_attention_backend(args.attention_backend, self.device)
        if latent_dim is not None and not self.attn_backend.latent_kv:
            logger.info("attention backend torch: %s does not serve a latent KV pool", type(self.attn_backend).__name__)
            self.attn_backend = select_attention_backend("torch", self.device)
        self.decode_graphs = self._decode_graphs()
        self.lora = LoraManager(self.model, cfg, args, self.dtype, self.device, args.tp_size) if args.lora_enabled else None
        logger.info(
            "KV pool%s: %d tokens of %s KV, %d bytes each (%.1f MiB), attention backend %s",
            "" if shard is None else f" of tp rank {shard.rank}",
            self.max_total_tokens,
            self.kv_format.name,
            self.kv_bytes_per_token,
            self.kv_pool.nbytes() / 2**20,
            type(self.attn_backend).__name__,
        )

    def _plan_states(self, cfg: ModelConfig, shards: list[TPShard | None]) -> None:
        """Reserve, out of the memory the KV pool may use, a hybrid model's linear-attention states:
        one slot per request-table row (the engine's table has ``max_running_requests + 8``) and as
        many snapshots for the radix tree, on every rank of ``shards`` (summed where the ranks share
        the host's memory); ``max_running_requests`` is lowered where they would take over half of it."""
        if cfg.linear is None:
            return
        args, layers = self.args, cfg.linear_layers
        per_rank = []
        for shard in shards:
            spec = linear_spec(cfg, shard)
            snapshot = StatePool.bytes_per_row(layers, spec.conv_state_shape, spec.state_shape, self.dtype)
            per_rank.append(snapshot + StatePool.bytes_per_row(layers, spec.conv_state_shape, spec.state_shape, self.dtype, args.page_size))  # its slot, and a snapshot in the tree
        per_row = sum(per_rank) if self.device.type == "cpu" else max(per_rank)
        fits = int(available_memory_bytes(self.device) * args.mem_fraction_static / 2 // per_row) - 8  # half the cache memory at most
        if fits < 1:
            raise ValueError(f"mem_fraction_static {args.mem_fraction_static} leaves no room for one request's linear-attention states ({per_row / 2**20:.1f} MiB)")
        if args.max_running_requests > fits:
            logger.warning("max_running_requests lowered from %d to %d: each request's linear-attention states take %.1f MiB", args.max_running_requests, fits, per_row / 2**20)
            args.max_running_requests = fits  # the request table and the scheduler are sized from it after the runner
        self.reserved_bytes = (args.max_running_requests + 8 + StatePool.SPARE) * per_row  # (a spare slot costs a little less than a row)

    def _state_pool(self) -> StatePool | None:
        """The linear-attention states of this rank's heads of a hybrid model (planned by
        ``_plan_states``: here without tensor parallelism, before the workers start with it)."""
        spec = linear_spec(self.config, self.shard)
        if spec is None:
            return None
        if self.group is None:
            self._plan_states(self.config, [None])
        args, layers = self.args, self.config.linear_layers
        rows = args.max_running_requests + 8
        pool = StatePool(rows, layers, spec.conv_state_shape, spec.state_shape, self.dtype, self.device, args.page_size)
        self.state_snapshots = StateSnapshots(pool, rows)
        if self.driver is not None:  # rank 0: the workers repeat its commits, snapshots and restores
            self.state_journal = pool.journal = self.state_snapshots.journal = StateJournal()
        logger.info("state pool: %d requests x %d linear-attention layers and as many tree snapshots, %.1f MiB",
                    rows, layers, (pool.nbytes() + self.state_snapshots.nbytes()) / 2**20)  # fmt: skip
        return pool

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode step, where they can run: one CUDA device, a backend that captures."""
        if self.device.type != "cuda" or self.args.disable_cuda_graph or self.group is not None or not self.attn_backend.captures_decode:
            return None
        if self.config.linear is not None:  # the linear-attention layers stage states per row: eager steps only
            logger.info("CUDA graphs off: a hybrid linear-attention model runs its decode steps eagerly")
            return None
        if self.config.moe is not None:  # routed experts choose their work on the host each step: not capturable
            logger.info("CUDA graphs off: a mixture-of-experts model runs its decode steps eagerly")
            return None
        max_bs = min(self.args.cuda_graph_max_bs, self.args.max_running_requests)
        return DecodeGraphs(self.model, self.kv_pool, self.attn_backend, self.pad_write_slot, max_bs, max_seq_len=self.context_len)

    @staticmethod
    def _build_cpu_kernels() -> None:
        """Compile (or find) the C++ CPU kernels now, so no request waits for the compiler."""
        t0 = time.perf_counter()
        ext = cpu_kernels()
        logger.info("C++ CPU kernels %s in %.1f s", "ready" if ext is not None else "unavailable", time.perf_counter() - t0)

    def _pool_size(self, bytes_per_token: int) -> int:
        page = self.args.page_size
        if self.args.max_total_tokens:
            n = self.args.max_total_tokens
        else:
            fraction = self.args.mem_fraction_static
            n = int((available_memory_bytes(self.device) * fraction - self.reserved_bytes) // bytes_per_token)
            n = min(n, 1 << 20)
        n -= n % page
        if n < page:
            raise ValueError(f"max_total_tokens {n} is smaller than one page ({page})")
        return n

    @property
    def tp_size(self) -> int:
        """Ranks the model is split over (1 without tensor parallelism)."""
        return 1 if self.group is None else self.group.size

    def on_failure(self, hook: Callable[[TensorParallelError], None]) -> None:
        """Have ``hook`` called when a tensor-parallel worker fails between steps."""
        if self.driver is not None:
            self.driver.on_failure(hook)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on the batch; returns fp32 logits of the rows in ``logits_indices``.

        On rank 0 of a tensor-parallel group, a failure once the plan is sent is a
        TensorParallelError: the ranks can no longer be in step, so the engine must stop."""
        if self.driver is None:
            return self._forward(batch)
        self.driver.check()
        try:
            send_batch(self.group, batch, self.state_journal)
            return self._forward(batch)
        except Exception as exc:
            raise self.driver.error_from(exc) from exc

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of ``batch.logits_indices``; where ``batch.hidden_indices`` is given, those
        tokens' final hidden states land in ``batch.hidden_out`` (a captured graph keeps none)."""
        if self.decode_graphs is not None and batch.hidden_indices is None and batch.lora is None:
            logits = self.decode_graphs.run(batch)
            if logits is not None:
                return logits
        self.attn_backend.init_forward_metadata(batch)
        if batch.state_pool is not None:
            batch.state_pool.begin(batch)
        if batch.lora is not None:
            with self.lora.running(batch.lora):
                hidden = self.model(batch)
        else:
            hidden = self.model(batch)
        if batch.hidden_indices is not None:
            batch.hidden_out = hidden.index_select(0, batch.hidden_indices).float()
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        if self.group is not None:
            logits = self.group.gather_vocab(logits, self.shard.vocab_per_rank, self.config.vocab_size)
        return logits

    def close(self) -> None:
        """Stop and join the tensor-parallel workers (nothing to do without them)."""
        if self.driver is not None:
            self.driver.close()
