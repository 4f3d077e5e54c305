"""Draft-model speculation: a cheaper model proposes K tokens per request, batched over requests.

Each proposal runs one draft forward pass per draft position for all rows together: the first
pass computes what the draft has not seen yet and the request's last token, each later pass
feeds the token just drafted. Every token is drawn from ``q``, the request's own sampling
settings (penalties, temperature, top-k/top-p/min-p) applied to the draft's logits, with the
request's generator when it has one; greedy rows take the draft's argmax. The decoder verifies
the drafts against the target in the next pass (``accept_draft`` with ``q``), so the output is
the target's whatever the draft proposes.

Two kinds of draft:

- **Self-draft** (no ``--speculative-draft-model-path``): the target's own weights quantized
  (``--speculative-draft-quantization``, int4 by default; the embedding is shared). It has the
  target's layers and heads, so it works in the TARGET's KV pool: for every verified position it
  reads the target's exact KV, and it writes its own approximate KV for positions
  ``seq_len - 1 .. seq_len + K - 2`` into the request's slots, reserved first with
  ``KVManager.reserve`` (a row for which the pool is short gets no proposal). Those positions
  are exactly the ones the verifying pass computes next (the last token and the drafts), so the
  target overwrites every approximate value before anything reads it as its own; the slots of
  rejected drafts are freed by the scheduler's truncate. No extra KV memory, no draft prefill,
  no per-request state.
- **Separate draft model** (``--speculative-draft-model-path``, HF folder or GGUF, optionally
  quantized): refused at start-up when its vocabulary differs from the target's. It keeps its
  own paged ``KVPool`` of the target pool's size, with the draft's layers and heads, indexed by
  the SAME slots as the target (so the target's slot table and reservations serve both). Per
  request it remembers which positions hold its KV (tokens and slots); each proposal first
  catches up the positions it has not computed (prompt, accepted tokens) in one extend row, then
  decodes. Draft KV is per request only: a prompt prefix that the radix tree shares is computed
  again by each request's draft. Every draft write stamps its slots with a pass number; a
  position is trusted only while its slot is the one recorded and still carries the recorded
  stamp, so a slot the tree swaps in for a running request's prefix (``cache_prefix``), or a page
  freed (rejected drafts) and handed back after another request's draft wrote it, is recomputed.

A proposal that raises leaves nothing behind that matters: reserved slots stay owned by the
request (the next truncate frees them), and the separate draft's bookkeeping is updated only
after the whole proposal succeeded, so the next call recomputes whatever was half written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.layers.attention import AttentionBackend, select_attention_backend
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.quant import quantize_model
from radixlm.runtime.loader import load_model, load_model_config, resolve_model_path
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.request import Req
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.proposal import Proposal, draw_chains, reserved
from radixlm.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SELF_DRAFT_QUANTIZATION = "int4"  # a self-draft's quantization when none is given


def check_draft_vocabulary(draft_path: str, target_vocab_size: int, target_tokenizer) -> None:
    """Raise ValueError naming ``speculative_draft_model_path`` when the draft's vocabulary
    (embedding size, or its tokenizer's token strings and ids) differs from the target's."""
    cfg = load_model_config(draft_path)
    if cfg.vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r}: the draft's vocabulary has {cfg.vocab_size} tokens, "
            f"the target's {target_vocab_size}; the draft must use the target's tokenizer"
        )
    draft_vocab = load_tokenizer(draft_path).get_vocab()
    target_vocab = target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])
        example = f" (e.g. token {differ[0][0]!r} = id {differ[0][1]} in only one)" if differ else ""
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r}: the draft's tokenizer differs from the target's "
            f"({len(draft_vocab)} vs {len(target_vocab)} token strings{example}); the draft must use the target's tokenizer"
        )


def check_draft_attention(draft_path: str) -> None:
    """Raise ValueError naming ``speculative_draft_model_path`` when the draft keeps anything but
    per-head KV (linear-attention states or a latent KV pool): its own pool holds only that."""
    cfg = load_model_config(draft_path)
    kind = "linear-attention layers (recurrent states)" if cfg.linear_layers else "latent attention (a latent KV pool)" if cfg.mla is not None else None
    if kind is not None:
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r}: the draft ({cfg.architecture}) has {kind}; a separate draft model "
            "must be an attention-only model with per-head KV (Llama, Qwen2/3, Mistral, ...)"
        )


def _quantize(model: LlamaForCausalLM, mode: str) -> None:
    """Quantize the draft's weights, naming the option when that is impossible."""
    try:
        quantize_model(model, mode)
    except ValueError as exc:
        raise ValueError(f"speculative_draft_quantization {mode!r}: {exc}") from exc


@dataclass
class _DraftKV:
    """Which positions of one request the separate draft's pool holds KV for."""

    final_len: int  # positions < final_len were computed with final (verified) tokens
    spec_tokens: list[int]  # drafts whose KV was written at positions final_len, final_len + 1, ...
    slots: torch.Tensor  # the slots of positions 0 .. final_len + len(spec_tokens)
    stamps: torch.Tensor  # the draft pass that last wrote each of those slots, when recorded


@dataclass
class _Row:
    """One request's share of a draft pass: tokens at positions start .. start + len(ids)."""

    index: int  # into the proposal's request list
    req: Req
    start: int
    ids: list[int]


def _table_shape(embedding: torch.nn.Module) -> tuple[int, int]:
    """Rows and width of a token table (dense or kept as GGUF blocks)."""
    return embedding.num_embeddings, embedding.embedding_dim


class DraftModelProposer:
    """Proposes tokens with a draft model (the quantized target, or a separate smaller model)."""

    name = "draft"

    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer, kv: KVManager) -> None:
        self.kv = kv
        self.runner = runner
        self.device = runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(args.random_seed)
        path = args.speculative_draft_model_path
        self.self_draft = path is None
        if self.self_draft:
            mode = args.speculative_draft_quantization or SELF_DRAFT_QUANTIZATION
            self.model, self.config = load_model(resolve_model_path(args.model_path), runner.dtype, self.device)
            _quantize(self.model, mode)
            if _table_shape(self.model.embed_tokens) == _table_shape(runner.model.embed_tokens):
                self.model.embed_tokens = runner.model.embed_tokens  # one copy of the embedding
            self.pool: KVPool = runner.kv_pool
            self.backend: AttentionBackend = runner.attn_backend
            self.context_len = runner.context_len
        else:
            path = resolve_model_path(path)
            check_draft_attention(path)
            check_draft_vocabulary(path, runner.config.vocab_size, tokenizer)
            self.model, self.config = load_model(path, runner.dtype, self.device)
            if args.speculative_draft_quantization:
                _quantize(self.model, args.speculative_draft_quantization)
            elif runner.dtype != torch.float32 and self.device.type == "cpu":
                self.model.keep_head_in_fp32()
            cfg = self.config
            self.pool = KVPool(runner.max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype, self.device, runner.kv_format)
            self.backend = select_attention_backend(args.attention_backend, self.device)
            self.context_len = min(runner.context_len, cfg.context_length)
            self._stamps = torch.zeros(runner.max_total_tokens, dtype=torch.int64, device=self.device)
        self.model.decode_stacks.enabled = not args.disable_decode_stack
        self._passes = 0
        self._state: dict[Req, _DraftKV] = {}

    # ------------------------------------------------------------ proposing
    def propose(self, reqs: list[Req], num_tokens: list[int]) -> list[Proposal]:
        """Up to ``num_tokens[i]`` drafts for ``reqs[i]`` (none where KV is short or it has drafts)."""
        proposals = [Proposal([]) for _ in reqs]
        rows = []
        for i, (req, k) in enumerate(zip(reqs, num_tokens)):
            if k <= 0 or req.kv is None or req.draft_ids or req.seq_len + k - 1 > self.context_len:
                continue
            if not reserved(self.kv, req, req.seq_len + k - 1):
                continue
            rows.append(_Row(i, req, self._computed_len(req), []))
        if not rows:
            return proposals
        for row in rows:
            row.ids = row.req.fill_ids[row.start :]
        follow = lambda row, _j, token: _Row(row.index, row.req, row.start + len(row.ids), [token])  # noqa: E731
        drafted, laws = draw_chains(rows, num_tokens, self.generator, self._forward, follow)
        for i, req in enumerate(reqs):
            if drafted[i]:
                proposals[i] = Proposal(drafted[i], torch.stack(laws[i]) if laws[i] else None)
                if not self.self_draft:
                    self._remember(req, drafted[i])
        return proposals

    def release(self, req: Req) -> None:
        """Forget the request's draft KV (it ended or was retracted)."""
        self._state.pop(req, None)

    # ------------------------------------------------------------ draft KV
    def _computed_len(self, req: Req) -> int:
        """Positions of ``req`` whose KV the draft can read now (the first it must compute)."""
        if self.self_draft:
            return req.kv.kv_len  # the target's own KV
        state = self._state.get(req)
        if state is None:
            return 0
        valid = state.final_len
        ids = req.fill_ids
        for tok in state.spec_tokens:
            if valid >= len(ids) or ids[valid] != tok:
                break
            valid += 1
        # slots past kv_len may have been freed (and reused) since; below it they were kept,
        # unless the tree swapped in its own copies of a prefix
        valid = min(valid, req.kv.kv_len, len(state.slots))
        slots = state.slots[:valid]
        changed = ((self.kv.slots(req.kv, 0, valid) != slots) | (self._stamps[slots] != state.stamps[:valid])).nonzero()
        return int(changed[0]) if len(changed) else valid

    def _remember(self, req: Req, drafted: list[int]) -> None:
        """Record the positions the draft's pool now holds for ``req`` (after a whole proposal)."""
        end = req.seq_len + len(drafted) - 1
        slots = self.kv.slots(req.kv, 0, end).clone()
        self._state[req] = _DraftKV(req.seq_len, drafted[:-1], slots, self._stamps[slots].clone())

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        """One draft pass over ``rows`` (reordered: decode rows first); logits of each row's last
        token ``[len(rows), V]`` in the new order."""
        rows.sort(key=lambda r: len(r.ids) != 1)
        device = self.device
        ids, positions, slots, last = [], [], [], []
        for row in rows:
            end = row.start + len(row.ids)
            ids.extend(row.ids)
            positions.append(torch.arange(row.start, end))
            slots.append(self.kv.slots(row.req.kv, row.start, end))
            last.append(len(ids) - 1)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.cat(positions).to(device),
            out_slots=torch.cat(slots),
            req_rows=torch.tensor([r.req.kv.row for r in rows], dtype=torch.int64, device=device),
            prefix_lens=[r.start for r in rows],
            extend_lens=[len(r.ids) for r in rows],
            num_decode=sum(1 for r in rows if len(r.ids) == 1),
            logits_indices=torch.tensor(last, dtype=torch.int64, device=device),
            req_to_token=self.kv.table.table,
            kv_pool=self.pool,
            attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(batch)
        if not self.self_draft:
            self._passes += 1
            self._stamps[batch.out_slots] = self._passes
        hidden = self.model(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
