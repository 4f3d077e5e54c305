"""Assembly: the engine's parts (tokenizer, model runner, KV memory, scheduler, grammar compiler,
prefill/decode hand-over) built from ServerArgs, without a loop thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from radixlm.radix_cache import KVManager, RadixCache, ReqToTokenTable, SlotAllocator
from radixlm.radix_cache.tiers import KVTiers
from radixlm.radix_cache.tiers.codec import KVCodec
from radixlm.runtime.constrained.compiler import GrammarCompiler
from radixlm.runtime.disaggregation.scheduling import Disaggregation, open_link_side
from radixlm.runtime.disk_cache import model_digest
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.tp_driver import TPDriver
from radixlm.runtime.loader import resolve_model_path
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.scheduler.step import Scheduler
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.threads import configure_threads
from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """The engine's parts assembled from ServerArgs, without a loop thread."""

    args: ServerArgs
    model_path: str
    tokenizer: Any
    runner: ModelRunner
    kv: KVManager
    scheduler: Scheduler
    grammars: GrammarCompiler
    pd: Disaggregation | None = None  # one side of a prefill/decode pair


def build_parts(args: ServerArgs) -> EngineParts:
    """Load the model and tokenizer and wire the KV memory and scheduler together."""
    configure_threads(args.num_threads, share=args.tp_size)
    model_path = resolve_model_path(args.model_path)
    tokenizer = load_tokenizer(model_path, args.tokenizer_path)
    runner = ModelRunner(args, model_path, start_tp=TPDriver)
    hybrid = runner.state_pool is not None
    if hybrid:
        _check_hybrid_options(args, runner.config.architecture)
    device = runner.device
    allocator = SlotAllocator(runner.max_total_tokens, args.page_size, device)
    width = -(-runner.context_len // args.page_size) * args.page_size  # whole pages per row
    table = ReqToTokenTable(args.max_running_requests + 8, width, device)
    tree = RadixCache(allocator.free_slots, args.page_size, disable=args.disable_radix_cache, track_origins=not args.disable_cache_explain)
    if hybrid:  # recurrent states exist only where they were computed: a prefix is reusable where the tree holds a snapshot
        tree.snapshots = runner.state_snapshots
    kv = KVManager(allocator, table, tree)
    if args.kv_tiers_enabled:
        kv.attach_tiers(make_kv_tiers(args, model_path, runner))
    end_ids = end_token_ids(tokenizer, runner.config.eos_token_ids)
    scheduler = Scheduler(args, runner, kv, OutputBuilder(tokenizer), end_ids, tokenizer)
    grammars = make_grammar_compiler(args, tokenizer, runner.config.vocab_size, end_ids)
    pd = Disaggregation(open_link_side(args, runner), runner.kv_pool, runner.state_pool) if args.disaggregation_mode else None
    if pd is not None:
        scheduler.attach_pd(pd)
    return EngineParts(args, model_path, tokenizer, runner, kv, scheduler, grammars, pd)


def _check_hybrid_options(args: ServerArgs, family: str) -> None:
    """Refuse, by name, the options a hybrid linear-attention model does not run with yet."""
    if args.kv_tiers_enabled:
        raise ValueError(f"kv_host_cache_gb / kv_disk_cache_dir do not run with a hybrid linear-attention model ({family}) yet: its recurrent states do not travel there")
    if args.speculative_algorithm == "draft" and args.speculative_draft_model_path is None:
        raise ValueError(
            f"speculative_algorithm='draft' without speculative_draft_model_path does not run with a hybrid linear-attention model ({family}): "
            "a self-draft would run the model's own linear-attention layers and needs states of its own; give an attention-only "
            "draft model (speculative_draft_model_path) or use 'ngram'"
        )


def make_kv_tiers(args: ServerArgs, model_path: str, runner: ModelRunner) -> KVTiers:
    """The host (and disk) tiers under the radix cache, named for this model and how it runs."""
    codec = KVCodec(runner.kv_pool, args.kv_tier_format)
    how = f"dtype={runner.dtype}|quantization={args.quantization}"
    digest = model_digest(model_path, how)
    disk_bytes = int(args.kv_disk_cache_gb * (1 << 30))
    tiers = KVTiers(codec, args.page_size, args.kv_host_cache_bytes, digest, args.kv_disk_cache_dir, disk_bytes, args.kv_tier_block_tokens)
    logger.info("KV tiers: host %.2f GiB%s, blocks of %d tokens stored %s (%d bytes a token)", args.kv_host_cache_bytes / (1 << 30),
                f", disk {args.kv_disk_cache_gb} GiB in {args.kv_disk_cache_dir}" if args.kv_disk_cache_dir else "", tiers.block_tokens, codec.label, codec.width)
    return tiers


def make_grammar_compiler(args: ServerArgs, tokenizer: Any, vocab_size: int, end_ids: set[int]) -> GrammarCompiler:
    """The compiler for ``args.grammar_backend`` (the backend itself is built on first use)."""

    def make_llguidance():
        from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, end_ids)

    def make_backend():
        if args.grammar_backend == "outlines":  # EBNF (tool_choice auto, reasoning) goes to llguidance
            from radixlm.runtime.constrained.lark_fallback import LarkFallback
            from radixlm.runtime.constrained.outlines_backend import OutlinesBackend

            return LarkFallback(OutlinesBackend(tokenizer, vocab_size, end_ids), make_llguidance)
        return make_llguidance()

    return GrammarCompiler(make_backend, args.grammar_backend, timeout=args.grammar_compile_timeout)
