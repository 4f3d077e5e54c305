"""What the scheduler holds: its parts, its queues and its counters."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.radix_cache.manager import KVManager
from radixlm.runtime.cache_explain import CacheExplainer
from radixlm.runtime.decoder import Decoder
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.faults import FaultInjector
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.hooks import DisaggregationHook
from radixlm.runtime.scheduler.prefill_clock import PrefillClock
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.speculator import Speculator

# The expected share of max_new_tokens a running request still decodes, for headroom estimates:
# it starts here, decays each step without a retraction and jumps to 1.0 on one.
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001


@dataclass
class StepStats:
    """Counters of the last step, for metrics and tests."""

    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_retracted: int = 0
    num_preempted: int = 0  # running requests that gave way to a more urgent one (priority policy)
    num_prefills_paused: int = 0  # unfinished prompts that sat the step out to let others run
    forward_s: float = 0.0


class SchedulerState:
    """The scheduler's parts, queues and counters, shared by admission, retraction and the forward."""

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        kv: KVManager,
        outputs: OutputBuilder,
        end_ids: set[int],
        tokenizer,
    ) -> None:
        self.args = args
        self.runner = runner
        self.kv = kv
        self.outputs = outputs
        self.end_ids = end_ids
        self.faults = FaultInjector() if args.debug_fault_injection else None
        self.decoder = Decoder(args, tokenizer, outputs, end_ids, runner.config.vocab_size, runner.context_len, runner.device, self.faults)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = StepStats()
        self.total_retracted = 0
        self.total_preempted = 0
        self.forward_passes = 0
        self.explainer = None if args.disable_cache_explain else CacheExplainer(tokenizer)
        self.finished_output_tokens = 0  # output tokens of ended requests (for tokens/s)
        self.prefill_tokens = 0  # prompt tokens computed, all steps
        self.speculator = Speculator(args, runner, tokenizer, kv)
        self.pd: DisaggregationHook | None = None  # the prefill/decode hand-over (attach_pd)
        self.prefill_yield_share = args.prefill_yield_share
        self.prefill_clocks: dict[Req, PrefillClock] = {}  # the unfinished prompts' clocks
        self._paused: list[Req] = []  # unfinished prompts sitting out the step being formed
        cfg = runner.config
        # every layer slides: a request lets go of the KV behind its window (not under PD, which
        # hands a prompt's whole KV over)
        self.kv_window = cfg.sliding_window if cfg.all_layers_slide and args.disaggregation_mode is None else None
