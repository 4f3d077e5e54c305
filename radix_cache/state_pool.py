"""StatePool: the recurrent and convolution states of linear-attention layers, one slot per request.

A hybrid model (Qwen3-Next, Qwen3.5) keeps, beside the KV of its full-attention layers, a fixed-size
state per request in each linear-attention layer (``radixlm.runtime.layers.gated_delta``). Slot
``r`` belongs to request-table row ``r``, so a running request holds exactly one. A state cannot be
cut back like KV pages: it exists only at the position where it was computed. So a forward pass
never overwrites the committed state; each layer **stages** what it computed, and after the pass the
scheduler **commits**, per row, the state at the length it kept (``commit``)::

    pass over a row verifying 3 drafts:  staged states after tokens  p, p+1, p+2, p+3
    2 drafts accepted (KV kept to p+3):  commit the state after p+2

A pass that raises commits nothing (its rows are re-run from the committed states), and a row
whose request starts over (a new prompt, or one retracted) begins from zeros.

Recurrent states are large (a MiB per layer and request at Qwen3.5-0.8B's shape), so a decode
step does not copy them at commit: each row's committed state lives in a **slot** of ``state``
(``home``), and the pool keeps ``spare`` slots besides the rows' own. A decode pass of at most
``spare`` rows has the fused kernel write each row's new state into a spare slot
(``decode_targets``); committing it swaps that slot and the row's old one, which becomes spare::

    row 3 at slot 3, spare 16:  kernel reads slot 3, writes slot 16
    commit (kept the new token): row 3 at slot 16, spare 3      (not kept: spare 16 again)

Under tensor parallelism every rank holds such a pool for its own heads. Rank 0 alone decides what
is committed and snapshotted; its pool and snapshot store write those decisions to a
``StateJournal`` (``radixlm.radix_cache.state_journal``) that the workers repeat before their next pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.radix_cache.state_journal import StateJournal


class PassRows(Protocol):
    """What the pool reads of a forward pass (``radixlm.runtime.layers.forward_batch.ForwardBatch``)."""

    pool_rows: torch.Tensor  # [B] the pool's rows of the pass's rows (rank 0's request-table rows)
    prefix_lens: list[int]
    extend_lens: list[int]
    batch_size: int
    seq_lens: list[int]

    def state_keep(self, row: int) -> int:
        """After how many of row ``row``'s last tokens a state is staged."""


class StatePool:
    """Per-request states of ``layers`` linear-attention layers for ``rows`` request-table rows."""

    SPARE = 4  # recurrent-state slots beyond the rows' own: decode passes of up to this many rows commit without a copy

    def __init__(
        self,
        rows: int,
        layers: int,
        conv_shape: tuple[int, ...],
        state_shape: tuple[int, ...],
        conv_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        spare: int = SPARE,
    ) -> None:
        if rows <= 0 or layers <= 0:
            raise ValueError("a state pool needs at least one row and one layer")
        self.rows, self.layers, self.page_size = rows, layers, page_size
        self.conv = torch.zeros((layers, rows, *conv_shape), dtype=conv_dtype, device=device)
        self.state = torch.zeros((layers, rows + spare, *state_shape), dtype=torch.float32, device=device)  # slots
        self.home = list(range(rows))  # per row: the slot of ``state`` that holds its committed state
        self._spare = list(range(rows + spare - 1, rows - 1, -1))
        self._targets: list[int] | None = None  # this pass: the slot each decode row's new state is written to ([]: none)
        self._target_index: torch.Tensor | None = None
        self.lengths = [0] * rows  # per row: the sequence length its committed state is the state after
        # pages of more than one token: each row's states at the last page boundary it passed (the
        # radix tree holds whole pages, so a finished request's snapshot is taken there)
        self.boundary: tuple[torch.Tensor, torch.Tensor] | None = None
        if page_size > 1:
            self.boundary = (torch.zeros_like(self.conv), torch.zeros((layers, rows, *state_shape), dtype=torch.float32, device=device))
        self.boundary_lengths = [0] * rows
        self._batch_rows: list[int] = []
        self._index: dict[int, int] = {}  # request-table row -> its row in the pass
        self._ends: list[int] = []
        self._keep: list[int] = []
        self._batch_extend: list[int] = []
        self._fresh: list[int] = []
        self._rows_index = self._homes_index = self._kernel_rows = self._kernel_slots = torch.zeros(0, dtype=torch.int64)
        self._staged: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(layers)]
        self._marked: list[dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in range(layers)]
        self._scratch: list[torch.Tensor | None] = [None] * layers  # per layer: the decode step's new states, reused pass to pass
        self.journal: StateJournal | None = None  # rank 0 of a tensor-parallel group: where its commits are written for the workers

    def nbytes(self) -> int:
        """Bytes the pool holds."""
        boundary = 0 if self.boundary is None else self.boundary[0].nbytes + self.boundary[1].nbytes
        return self.conv.nbytes + self.state.nbytes + boundary

    def committed(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s committed conv and recurrent states over all layers (views, ``[layers, ...]``)."""
        return self.conv[:, row], self.state[:, self.home[row]]

    @staticmethod
    def bytes_per_row(layers: int, conv_shape: tuple[int, ...], state_shape: tuple[int, ...], conv_dtype: torch.dtype, page_size: int = 1) -> int:
        """Bytes one request's slot takes over all layers (twice over with pages of several tokens)."""
        conv = torch.Size(conv_shape).numel() * torch.empty((), dtype=conv_dtype).element_size()
        return layers * (conv + torch.Size(state_shape).numel() * 4) * (1 if page_size == 1 else 2)

    def begin(self, batch: PassRows) -> None:
        """Start a pass over ``batch``: forget anything staged by a pass that never committed."""
        self._release_targets()
        self._batch_rows = batch.pool_rows.tolist()
        self._index = {row: i for i, row in enumerate(self._batch_rows)}
        for row, prefix in zip(self._batch_rows, batch.prefix_lens):
            if prefix == 0:
                self.lengths[row] = self.boundary_lengths[row] = 0  # starts over from zeros (read gives them)
        self._ends = batch.seq_lens
        self._keep = [batch.state_keep(i) for i in range(batch.batch_size)]
        self._batch_extend = list(batch.extend_lens)
        for staged in (*self._staged, *self._marked):
            staged.clear()
        # each row's conv row and recurrent-state slot, the same for every layer of the pass (-1: zeros, in the kernels' form)
        self._fresh = [i for i, p in enumerate(batch.prefix_lens) if p == 0]
        self._rows_index = torch.tensor(self._batch_rows, dtype=torch.int64)
        self._homes_index = torch.tensor([self.home[r] for r in self._batch_rows], dtype=torch.int64)
        self._kernel_rows, self._kernel_slots = self._rows_index.clone(), self._homes_index.clone()
        self._kernel_rows[self._fresh] = self._kernel_slots[self._fresh] = -1

    def read(self, layer: int, states_from: int = 0, conv_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed conv states of the pass's rows ``conv_from`` on in ``layer`` and recurrent
        states of its rows ``states_from`` on (zeros for a row that starts its sequence):
        ``[B - conv_from, *conv_shape]``, ``[B - states_from, *state_shape]``, copies. (Kernels
        read the first rows' states where they lie instead: ``in_place``, ``in_place_conv``.)"""
        device = self.state.device
        rows, homes = self._rows_index[conv_from:].to(device), self._homes_index[states_from:].to(device)
        conv, state = self.conv[layer].index_select(0, rows), self.state[layer].index_select(0, homes)
        for part, start in ((conv, conv_from), (state, states_from)):
            zeros = [i - start for i in self._fresh if i >= start]
            if zeros:
                part[zeros] = 0
        return conv, state

    def in_place_conv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed conv states of ``layer``, ``[rows, *conv_shape]`` (to read only), and the
        row of each of the pass's first ``n`` rows (int64 ``[n]``; -1 for a row that starts its
        sequence: zeros)."""
        return self.conv[layer], self._kernel_rows[:n]

    def in_place(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrent state slots of ``layer``, ``[slots, *state_shape]`` (to read only: the
        committed ones change at ``commit`` alone), and for each of the pass's first ``n`` rows
        the slot of its committed state (int64 ``[n]``; -1 for a row that starts its sequence: its
        state is zeros)."""
        return self.state[layer], self._kernel_slots[:n]

    def decode_targets(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where the fused kernel writes the new recurrent states of the pass's first ``n`` rows
        (decode rows) in ``layer``: the state slots and a spare slot per row (int64 ``[n]``) when
        the pool has that many spare, else ``scratch`` and None (row ``i`` at ``i``). The same
        slots serve every layer of the pass; a row whose state ``commit`` keeps moves to its slot."""
        if self._targets is None:
            self._targets = [self._spare.pop() for _ in range(n)] if n <= len(self._spare) else []
            self._target_index = torch.tensor(self._targets, dtype=torch.int64)
        if len(self._targets) != n:
            return self.scratch(layer, n), None
        return self.state[layer], self._target_index

    def _release_targets(self) -> None:
        """Give back the spare slots of a pass that did not commit them."""
        if self._targets:
            self._spare.extend(self._targets)
        self._targets = self._target_index = None

    def scratch(self, layer: int, rows: int) -> torch.Tensor:
        """Room for ``rows`` new recurrent states of ``layer`` in this pass (``[rows, *state_shape]``,
        contents undefined), kept from pass to pass: a fresh allocation of that size each layer
        step costs more in page faults than the decode step itself. Valid until the next pass begins."""
        buf = self._scratch[layer]
        if buf is None or buf.shape[0] < rows:
            buf = self._scratch[layer] = torch.empty((rows, *self.state.shape[2:]), dtype=self.state.dtype, device=self.state.device)
        return buf[:rows]

    def stage(self, layer: int, index: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Batch row ``index``'s states after each of its last ``state_keep`` tokens in ``layer``:
        ``[keep, *conv_shape]`` and ``[keep, *state_shape]``."""
        self._staged[layer][index] = (conv, state)

    def stage_marks(self, layer: int, index: int, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Batch row ``index``'s states in ``layer`` after ``h`` of its new tokens, for each ``h``
        of ``states`` (``h -> (conv, state)``): the points the radix tree snapshots."""
        self._marked[layer][index] = states

    def marks(self, index: int) -> list[int]:
        """The sequence positions of batch row ``index`` whose states were marked in the pass,
        ascending (``state_at`` gives them until the next pass begins)."""
        if index not in self._marked[0]:
            return []
        start = self._ends[index] - self._batch_extend[index]
        return [start + h for h in sorted(self._marked[0][index])]

    def _keep_boundary(self, i: int, row: int, length: int) -> None:
        """Copy batch row ``i``'s staged states at the last page boundary up to ``length``, where it staged them."""
        if self.boundary is None:
            return
        at = length // self.page_size * self.page_size - (self._ends[i] - self._keep[i]) - 1
        if not 0 <= at < self._keep[i]:
            return
        for layer, staged in enumerate(self._staged):
            conv, state = staged[i]
            self.boundary[0][layer, row] = conv[at]
            self.boundary[1][layer, row] = state[at]
        self.boundary_lengths[row] = length // self.page_size * self.page_size

    def state_at(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Request-table row ``row``'s states after ``length`` tokens over all layers (``[layers, ...]``),
        staged or marked by the last pass, or committed; None where none holds them."""
        i = self._index.get(row)
        if i is not None and i in self._staged[0]:
            at = length - (self._ends[i] - self._keep[i]) - 1
            if 0 <= at < self._keep[i]:
                return torch.stack([s[i][0][at] for s in self._staged]), torch.stack([s[i][1][at] for s in self._staged])
        if i is not None and i in self._marked[0]:
            h = length - (self._ends[i] - self._batch_extend[i])
            if h in self._marked[0][i]:
                return torch.stack([m[i][h][0] for m in self._marked]), torch.stack([m[i][h][1] for m in self._marked])
        if self.lengths[row] == length and length > 0:
            return self.committed(row)
        if self.boundary is not None and self.boundary_lengths[row] == length and length > 0:
            return self.boundary[0][:, row], self.boundary[1][:, row]
        return None

    def load(self, row: int, conv: torch.Tensor, state: torch.Tensor, length: int) -> None:
        """Start row ``row`` from the states ``conv`` and ``state`` (``[layers, ...]``, after ``length`` tokens)."""
        self.conv[:, row] = conv
        self.state[:, self.home[row]] = state
        self.lengths[row] = length
        self.boundary_lengths[row] = 0  # nothing of the row's previous request is known any more

    @property
    def row_format(self) -> str:
        """The dtypes and shapes of one row's states (two pools exchange rows only where they match)."""
        return f"conv {self.conv.dtype} {tuple(self.conv[:, 0].shape)}, state {self.state.dtype} {tuple(self.state[:, 0].shape)}"

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row's states over all layers."""
        return self.conv[:, 0].numel() * self.conv.element_size() + self.state[:, 0].numel() * self.state.element_size()

    def pack(self, row: int, length: int) -> torch.Tensor | None:
        """Row ``row``'s states after ``length`` tokens as ``row_nbytes`` bytes (on the CPU), or
        None where the pool does not hold them (``state_at``)."""
        states = self.state_at(row, length)
        if states is None:
            return None
        return torch.cat([t.contiguous().reshape(-1).view(torch.uint8).cpu() for t in states])

    def unpack(self, row: int, data: torch.Tensor, length: int) -> None:
        """Start row ``row`` from ``pack``'s bytes of another pool of the same ``row_format``."""
        if data.numel() != self.row_nbytes:
            raise ValueError(f"linear-attention states of {data.numel()} bytes, expected {self.row_nbytes}")
        split = self.conv[:, 0].numel() * self.conv.element_size()
        data = data.to(self.conv.device)
        conv = data[:split].view(self.conv.dtype).view(self.conv[:, 0].shape)
        state = data[split:].view(self.state.dtype).view(self.state[:, 0].shape)
        self.load(row, conv, state, length)

    def commit(self, kept: list[int | None]) -> None:
        """Make the staged states current: batch row ``i`` kept its first ``kept[i]`` positions
        (None: the row's request ended, nothing to keep). Raises ValueError, changing nothing,
        when no state was staged at a kept length."""
        if len(kept) != len(self._batch_rows):
            raise ValueError(f"commit of {len(kept)} rows for a pass of {len(self._batch_rows)}")
        picks: list[int | None] = []  # per batch row: the staged state it keeps (None: its committed one stays)
        for i, length in enumerate(kept):
            row = self._batch_rows[i]
            if length is None or (length == self._ends[i] - self._batch_extend[i] and self.lengths[row] == length):
                picks.append(None)  # ended, or none of the pass's tokens kept (a prompt's only token under max_new_tokens 0)
                continue
            at = length - (self._ends[i] - self._keep[i]) - 1
            if not 0 <= at < self._keep[i]:
                raise ValueError(f"row {i} kept {length} positions; states were staged for {self._ends[i] - self._keep[i] + 1}..{self._ends[i]}")
            picks.append(at)
        targets, freed = self._targets or [], []
        for i, at in enumerate(picks):
            if at is None:
                continue
            row = self._batch_rows[i]
            in_slot = i < len(targets) and at == self._keep[i] - 1  # written by the kernel into spare slot targets[i]
            for layer, staged in enumerate(self._staged):
                conv, state = staged[i]
                self.conv[layer, row] = conv[at]
                if not in_slot:
                    self.state[layer, self.home[row]] = state[at]
            if in_slot:
                freed.append(self.home[row])
                self.home[row], targets[i] = targets[i], -1
            self.lengths[row] = kept[i]
            self._keep_boundary(i, row, kept[i])
        self._spare.extend([t for t in targets if t >= 0] + freed)  # the slots not taken, and the homes left
        self._targets = self._target_index = None
        for staged in self._staged:
            staged.clear()  # (marks stay readable until the next pass begins)
        if self.journal is not None:
            self.journal.commit(kept)
