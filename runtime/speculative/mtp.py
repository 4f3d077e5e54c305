"""MTP speculation: DeepSeek-V3's multi-token-prediction layer proposes K tokens per request.

The MTP layer (``radixlm.runtime.models.deepseek.DeepseekMTP``) predicts ``x_{p+2}`` from the
target's hidden state ``h_p`` (before its final norm) and the token ``x_{p+1}``; each later draft
feeds the MTP's own hidden state and the token just drafted. Drafts are drawn from the request's
own sampling settings applied to the MTP's logits (greedy rows: the argmax), with their law ``q``,
and verified by the decoder as any draft model's are: the output is the target's whatever the MTP
proposes; the MTP decides only how many drafts are accepted.

Hidden states. While this proposer runs, the target keeps its last pass's pre-norm hidden states
(``DenseForCausalLM.keep_hidden``); the scheduler calls ``observe`` after every pass (each half
of a split pass too), once the pass's drafts are verified, and the proposer takes, per request,
the hidden states of the positions the pass computed with final tokens (``p <= verified - 2``:
``x_{p+1}`` is then known). They wait as the request's pending positions until its next proposal,
which computes them in its first MTP pass; a request the gate leaves out for long (or a prompt
chunk) has them computed at once when more than ``PENDING_LIMIT`` wait, all but the last.

MTP KV. The MTP keeps its own one-layer latent ``KVPool`` of the target pool's size, indexed by
the SAME slots as the target's. Per request it remembers which positions hold MTP KV computed
from the target's hidden states (its context: positions, slots, and the MTP pass that wrote each
slot). Every MTP pass attends through its own slot table, one row per request listing only its
context's slots, so positions whose target hidden state was never seen (a prefix the radix cache
served, positions of a lost pass) are simply not in the MTP's attention context; they are not
recomputed. A context position is dropped when its slot is no longer the request's (the tree
swapped in its copy of a prefix) or another MTP pass wrote that slot since (a freed page reused).
Chained drafts write MTP KV at the positions being drafted (slots reserved with
``KVManager.reserve``) and are never recorded: the next proposal recomputes those positions from
the target's hidden states.

A proposal that raises leaves nothing behind that matters: the context and pending positions are
updated only after the whole proposal succeeded, and the Speculator decodes every row plainly
that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.checkpoints.folder import dense_tensors, tensor_names
from radixlm.runtime.checkpoints.install import materialize
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.layers.attention import select_attention_backend
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.loader import is_gguf, resolve_model_path
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.deepseek import (
    SHARED_PARAMS,
    DeepseekForCausalLM,
    DeepseekMTP,
    mtp_config,
)
from radixlm.runtime.request import Req
from radixlm.runtime.schedule_batch import Row
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.proposal import Proposal, draw_chains, reserved

logger = logging.getLogger(__name__)

PENDING_LIMIT = 32  # a request's waiting target hidden states computed at once past this many


def has_mtp_weights(path: str, cfg: ModelConfig) -> bool:
    """True where ``cfg`` declares an MTP layer and the checkpoint at ``path`` holds its tensors
    (read from the files' headers)."""
    prefix = f"model.layers.{cfg.num_layers}.eh_proj."
    if cfg.mtp_layers == 0 or is_gguf(path):  # GGUF files leave the MTP layers out (``gguf_deepseek``)
        return False
    return any(name.startswith(prefix) for name in tensor_names(path))


def load_mtp(path: str, target: DeepseekForCausalLM, dtype: torch.dtype, device: torch.device) -> DeepseekMTP:
    """The first MTP layer of the checkpoint at ``path`` (its tensors alone read, dequantized),
    sharing ``target``'s embedding and head where its own are absent or equal."""
    cfg = target.config
    prefix = f"model.layers.{cfg.num_layers}."
    tensors = list(dense_tensors(path, prefix))
    with torch.device("meta"):
        mtp = DeepseekMTP(mtp_config(cfg), cfg.num_layers)
    materialize(mtp, device, dtype)
    mtp.rebuild_buffers(device)
    names = {name[len(prefix) :] for name, _ in tensors}
    with torch.no_grad():
        mtp.load_weights(iter(tensors))
        mtp.share(target, {own for own, name in zip(SHARED_PARAMS, ("embed_tokens.weight", "shared_head.head.weight")) if name in names})
    return mtp.eval()


def check_mtp_model(args: ServerArgs, runner: ModelRunner) -> None:
    """Raise ValueError naming ``speculative_algorithm`` unless the target's checkpoint carries MTP weights."""
    model, cfg = runner.model, runner.config
    if not isinstance(model, DeepseekForCausalLM) or not has_mtp_weights(resolve_model_path(args.model_path), cfg):
        raise ValueError(
            f"speculative_algorithm 'mtp': the model ({cfg.architecture}) has no multi-token-prediction weights "
            "(a DeepSeek-V3 checkpoint with num_nextn_predict_layers and its model.layers.{num_hidden_layers} tensors); use 'ngram' or 'draft'"
        )


@dataclass
class _MtpState:
    """One request's MTP context (positions whose MTP KV came from target hidden states) and the
    target hidden states still waiting to be computed."""

    positions: torch.Tensor
    slots: torch.Tensor
    stamps: torch.Tensor  # the MTP pass that wrote each slot, when recorded
    pending_pos: list[torch.Tensor] = field(default_factory=list)  # ascending runs of positions
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # their target hidden states

    def pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The waiting positions and hidden states, joined (None: none wait)."""
        if not self.pending_pos:
            return None
        return torch.cat(self.pending_pos), torch.cat(self.pending_hidden)


@dataclass
class _Row:
    """One request's share of an MTP pass: tokens ``x_{p+1}`` at positions ``p``, with ``h_p``."""

    index: int  # into the caller's request list
    req: Req
    context: torch.Tensor  # slots the row attends to before its new tokens
    ids: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    hidden: torch.Tensor


class MtpProposer:
    """Proposes tokens with the target checkpoint's multi-token-prediction layer."""

    name = "mtp"

    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer, kv: KVManager) -> None:
        check_mtp_model(args, runner)
        self.kv = kv
        self.runner = runner
        self.device = runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(args.random_seed)
        self.model = load_mtp(resolve_model_path(args.model_path), runner.model, runner.dtype, self.device)
        heads, width, latent = self.model.config.kv_layout()
        self.pool = KVPool(runner.max_total_tokens + 1, 1, heads, width, runner.dtype, self.device, runner.kv_format, latent)
        self.backend = runner.attn_backend if runner.attn_backend.latent_kv else select_attention_backend("torch", self.device)
        self._stamps = torch.zeros(runner.max_total_tokens + 1, dtype=torch.int64, device=self.device)
        self._passes = 0
        self._state: dict[Req, _MtpState] = {}
        runner.model.keep_hidden = True

    # ------------------------------------------------------------ target hidden states
    def observe(self, rows: list[Row]) -> None:
        """Take the hidden states of the target pass over ``rows`` (in the batch's order) at the
        positions it computed with final tokens; compute them now where too many wait."""
        hidden, self.runner.model.kept_hidden = self.runner.model.kept_hidden, None
        if hidden is None:
            return
        start, full = 0, []
        for row in rows:
            req, first = row.req, start
            start += row.length
            if req.finish is not None or req.kv is None:
                continue
            end = min(row.start + row.length, req.seq_len - len(req.draft_ids) - 1)  # x_{p+1} final for p < end
            if end <= row.start:
                continue
            state = self._state.get(req) or self._state.setdefault(req, self._empty_state())
            state.pending_pos.append(torch.arange(row.start, end, device=self.device))
            state.pending_hidden.append(hidden[first : first + end - row.start].clone())
            if sum(len(p) for p in state.pending_pos) > PENDING_LIMIT:
                full.append(req)
        if full:
            self._catch_up(full)

    def _catch_up(self, reqs: list[Req]) -> None:
        """Compute all but the last of the requests' waiting positions into their MTP context."""
        rows, tails = [], {}
        for i, req in enumerate(reqs):
            pos, hid = self._state[req].pending()
            rows.append(self._row(i, req, pos[:-1], hid[:-1]))
            tails[req] = ([pos[-1:]], [hid[-1:]])
        self._forward(rows)
        for row in rows:
            self._commit(row)
            state = self._state[row.req]
            state.pending_pos, state.pending_hidden = tails[row.req]

    # ------------------------------------------------------------ proposing
    def propose(self, reqs: list[Req], num_tokens: list[int]) -> list[Proposal]:
        """Up to ``num_tokens[i]`` drafts for ``reqs[i]`` (none where the target's hidden state of
        its last verified position is unknown, KV is short, or it has drafts)."""
        proposals = [Proposal([]) for _ in reqs]
        rows = []
        for i, (req, k) in enumerate(zip(reqs, num_tokens)):
            state = self._state.get(req)
            if k <= 0 or req.kv is None or req.draft_ids or state is None or not state.pending_pos:
                continue
            pos, hid = state.pending()
            if int(pos[-1]) != req.seq_len - 2 or req.seq_len + k - 2 > self.runner.context_len:
                continue
            if not reserved(self.kv, req, req.seq_len + k - 2):
                continue
            rows.append(self._row(i, req, pos, hid))
        if not rows:
            return proposals
        first = list(rows)
        last: list[torch.Tensor] = []  # the pass's hidden states, row by row, for the rows that follow

        def step(rows: list[_Row]) -> torch.Tensor:
            last[:] = [self._forward(rows)]
            return self.model.compute_logits(last[0])

        def follow(row: _Row, j: int, token: int) -> _Row:  # the MTP's own hidden state and the token drafted
            p = int(row.positions[-1]) + 1
            slot = self.kv.slots(row.req.kv, p, p + 1)
            return _Row(row.index, row.req, torch.cat([row.context, row.slots]), [token], row.positions[-1:] + 1, slot, last[0][j : j + 1])

        drafted, laws = draw_chains(rows, num_tokens, self.generator, step, follow)
        for row in first:
            self._commit(row)
            self._state[row.req].pending_pos, self._state[row.req].pending_hidden = [], []
        for i in range(len(reqs)):
            if drafted[i]:
                proposals[i] = Proposal(drafted[i], torch.stack(laws[i]) if laws[i] else None)
        return proposals

    def release(self, req: Req) -> None:
        """Forget the request's MTP context and waiting hidden states (it ended or was retracted)."""
        self._state.pop(req, None)

    # ------------------------------------------------------------ MTP KV
    def _empty_state(self) -> _MtpState:
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        return _MtpState(none, none, none)

    def _context(self, req: Req) -> _MtpState:
        """The request's state with its context cut to the positions whose MTP KV is still its own."""
        state = self._state[req]
        if len(state.positions):
            table = self.kv.table.table[req.kv.row]
            ok = (state.positions < req.kv.kv_len) & (table[state.positions] == state.slots) & (self._stamps[state.slots] == state.stamps)
            state.positions, state.slots, state.stamps = state.positions[ok], state.slots[ok], state.stamps[ok]
        return state

    def _row(self, index: int, req: Req, positions: torch.Tensor, hidden: torch.Tensor) -> _Row:
        """A catch-up row: the MTP at ``positions`` from the target's ``hidden`` there."""
        state = self._context(req)
        fill = req.fill_ids
        ids = [fill[p + 1] for p in positions.tolist()]
        slots = self.kv.table.table[req.kv.row, positions]
        return _Row(index, req, state.slots[state.positions < positions[0]], ids, positions, slots, hidden)

    def _commit(self, row: _Row) -> None:
        """Add a catch-up row's positions to its request's MTP context (after the whole call succeeded)."""
        state = self._state[row.req]
        keep = state.positions < row.positions[0]
        state.positions = torch.cat([state.positions[keep], row.positions])
        state.slots = torch.cat([state.slots[keep], row.slots])
        state.stamps = torch.cat([state.stamps[keep], self._stamps[row.slots]])

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        """One MTP pass over ``rows`` (reordered: decode rows first), each attending to its context
        through a slot table of its own; the pre-norm hidden state of each row's last token."""
        rows.sort(key=lambda r: len(r.ids) != 1)
        device = self.device
        width = max(len(r.context) + len(r.ids) for r in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
        last, count = [], 0
        for i, r in enumerate(rows):
            table[i, : len(r.context) + len(r.ids)] = torch.cat([r.context, r.slots])
            count += len(r.ids)
            last.append(count - 1)
        batch = ForwardBatch(
            input_ids=torch.tensor([t for r in rows for t in r.ids], dtype=torch.int64, device=device),
            positions=torch.cat([r.positions for r in rows]),
            out_slots=torch.cat([r.slots for r in rows]),
            req_rows=torch.arange(len(rows), device=device),
            prefix_lens=[len(r.context) for r in rows],
            extend_lens=[len(r.ids) for r in rows],
            num_decode=sum(1 for r in rows if len(r.ids) == 1),
            logits_indices=torch.tensor(last, dtype=torch.int64, device=device),
            req_to_token=table,
            kv_pool=self.pool,
            attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(batch)
        self._passes += 1
        self._stamps[batch.out_slots] = self._passes
        hidden = self.model(batch, torch.cat([r.hidden for r in rows]))
        return hidden.index_select(0, batch.logits_indices)
