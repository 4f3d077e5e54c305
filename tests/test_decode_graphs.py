"""Captured decode steps (CUDA graphs) replayed from static buffers give the eager step's results.

No CUDA here: ``RecordedStep`` stands in for ``torch.cuda.CUDAGraph``. It keeps the step that
was "captured" and runs it again on replay, reading only the static tensors and the Python values
fixed at capture, as a graph does; the Triton backend runs in its interpreter. What these tests
protect is the graph runner's side: the static inputs, the padding of a bucket's spare rows, the
fixed split count, which batches replay and which run eagerly, and a failed capture.
``benchmarks/gpu_check.py`` checks the real capture on a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import good_and_bad_requests, run_and_check_only_bad_failed
from radixlm.runtime.engine import build_parts
from radixlm.runtime.executor.decode_graphs import DecodeGraphs, graph_buckets
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

PROMPTS = ([5, 9, 14, 3, 22, 40, 7], [31, 8, 8, 60, 2], [17, 4], [50, 51, 52, 53, 54, 55, 56, 57, 58], [11], [12, 13, 14])
STEPS = (9, 2, 6, 4, 7, 3)  # requests finish at different steps: the batch shrinks inside a bucket


class RecordedStep:
    """Stands in for a CUDA graph: ``capture`` runs the step once and keeps it, ``replay`` runs it again."""

    captures = 0

    def __init__(self) -> None:
        self.fn = None

    def capture(self, fn) -> None:
        fn()
        self.fn = fn
        RecordedStep.captures += 1

    def replay(self) -> None:
        self.fn()


class FailingCapture(RecordedStep):
    def capture(self, fn) -> None:
        fn()  # the warm-up ran (and wrote padding KV) before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")


def _parts(model_path: str, graphs: type | None, max_bs: int = 8, **args):
    rt = build_parts(ServerArgs(model_path=model_path, max_total_tokens=512, attention_backend="triton", device="cpu", **args))
    runner = rt.runner
    assert runner.decode_graphs is None  # on a CPU the runner builds none itself
    if graphs is not None:
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_pool, runner.attn_backend, runner.pad_write_slot, max_bs, make_graph=graphs, max_seq_len=runner.context_len)
    return rt


def _generate(rt, prompts=PROMPTS, steps=STEPS) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for i, (ids, n) in enumerate(zip(prompts, steps)):
        rt.scheduler.add(Req(rid=str(i), input_ids=list(ids), params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), sink=lambda out, i=i: outputs.__setitem__(str(i), out)))
    while rt.scheduler.waiting or rt.scheduler.running:
        rt.scheduler.step()
    assert all(out.finished for out in outputs.values()) and len(outputs) == len(prompts)
    return {rid: out.output_ids for rid, out in outputs.items()}


def _decode_batch(rt, seqs: list[list[int]]):
    """A decode-only ForwardBatch over fresh KV: row i has ``seqs[i][:-1]`` cached and decodes ``seqs[i][-1]``."""
    from radixlm.runtime.layers.forward_batch import ForwardBatch

    runner, kv = rt.runner, rt.kv
    gen = torch.Generator().manual_seed(len(seqs))
    rows, slots = [], []
    for ids in seqs:
        row = kv.table.alloc()
        got = kv.allocator.alloc_slots(len(ids))
        kv.table.write(row, 0, got)
        rows.append(row)
        slots.append(got)
        pool = runner.kv_pool
        for layer in range(pool.num_layers):  # a random cached prefix
            shape = (len(ids) - 1, pool.num_kv_heads, pool.head_dim)
            pool.write(layer, got[:-1], torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    n = len(seqs)
    batch = ForwardBatch(
        input_ids=torch.tensor([s[-1] for s in seqs]),
        positions=torch.tensor([len(s) - 1 for s in seqs]),
        out_slots=torch.stack([s[-1] for s in slots]),
        req_rows=torch.tensor(rows),
        prefix_lens=[len(s) - 1 for s in seqs],
        extend_lens=[1] * n,
        num_decode=n,
        logits_indices=torch.arange(n),
        req_to_token=kv.table.table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )
    return batch, rows, slots


def _eager_logits(runner, batch) -> torch.Tensor:
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        return runner.forward(batch)
    finally:
        runner.decode_graphs = graphs


def test_graph_buckets_cover_every_size_up_to_the_largest_and_refuse_a_bad_one():
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        graph_buckets(0)
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0).validate()


def test_replayed_decode_steps_give_the_eager_greedy_tokens(tiny_llama):
    eager = _generate(_parts(tiny_llama, None))
    rt = _parts(tiny_llama, RecordedStep)
    graphed = _generate(rt)
    graphs = rt.runner.decode_graphs
    assert graphs.enabled and graphs.replays >= 8  # the decode steps replayed (prefill steps ran eagerly)
    assert graphed == eager


def test_a_replayed_step_equals_the_eager_step_and_writes_only_its_own_kv_slots(tiny_llama):
    rt = _parts(tiny_llama, RecordedStep)
    runner = rt.runner
    graphs = runner.decode_graphs
    pool = runner.kv_pool
    for t in pool.k + pool.v:  # the pool is torch.empty: a NaN left in memory would never equal itself
        t.zero_()
    big, _, big_slots = _decode_batch(rt, [[3, 4, 5, 6], [7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19]])
    want = _eager_logits(runner, big)
    got = runner.forward(big)  # 5 rows in the bucket of 8: 3 padded rows
    assert graphs.replays == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tiny, _, _ = _decode_batch(rt, [[30, 31], [32, 33, 34], [35, 36, 37, 38]])  # 3 rows: the bucket of 4 ...
    runner.forward(tiny)  # (captured now: every row padded)
    runner.forward(big)  # ... after a step that filled rows 3 and 4 of the static buffers with other requests,
    gen = torch.Generator().manual_seed(1)
    for t in pool.k + pool.v:  # which then finished: other requests own their slots and wrote other KV there
        for slots in big_slots:
            t[slots] = torch.randn(t[slots].shape, generator=gen)
    before = [t.clone() for t in pool.k + pool.v]
    want = _eager_logits(runner, tiny)
    written = torch.zeros(pool.num_slots, dtype=torch.bool)
    written[tiny.out_slots] = True
    after_eager = [t.clone() for t in pool.k + pool.v]
    got = runner.forward(tiny)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written[runner.pad_write_slot] = True
    for layer, (old, new, eager_kv) in enumerate(zip(before, pool.k + pool.v, after_eager)):
        assert torch.equal(old[~written], new[~written]), f"pool tensor {layer}: a padded row wrote into a slot it does not own"
        # the batch's own KV, as the eager step wrote it (to rounding: the replay's projections run at the
        # bucket's padded row count, and a BLAS may round another row count differently)
        torch.testing.assert_close(new[tiny.out_slots], eager_kv[tiny.out_slots], rtol=1e-5, atol=1e-5)
    assert graphs.captured == [4, 8]


def test_batches_with_a_prefill_row_or_past_the_largest_bucket_run_eagerly(tiny_llama):
    rt = _parts(tiny_llama, RecordedStep, max_bs=2)
    graphs = rt.runner.decode_graphs
    batch, _, _ = _decode_batch(rt, [[1, 2], [3, 4], [5, 6]])
    assert not graphs.can_run(batch)  # 3 rows > 2
    two, _, _ = _decode_batch(rt, [[1, 2], [3, 4]])
    assert graphs.can_run(two)
    two.num_decode = 1  # the second row extends a prompt
    assert not graphs.can_run(two)
    assert graphs.run(two) is None and graphs.replays == 0


def test_a_failed_capture_turns_graphs_off_and_the_steps_run_eagerly(tiny_llama, caplog):
    eager = _generate(_parts(tiny_llama, None))
    rt = _parts(tiny_llama, FailingCapture)
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.executor.decode_graphs"):
        out = _generate(rt)
    assert out == eager
    graphs = rt.runner.decode_graphs
    assert not graphs.enabled and graphs.replays == 0
    assert "capturing the decode step" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a CUDA device (benchmarks/gpu_check.py runs this)")
def test_cuda_graphs_give_the_eager_greedy_tokens_on_cuda(tiny_llama):
    def cuda_parts(disable: bool):
        return build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=512, device="cuda", dtype="float32", disable_cuda_graph=disable, cuda_graph_max_bs=8))

    eager = _generate(cuda_parts(True))
    rt = cuda_parts(False)
    assert rt.runner.decode_graphs is not None
    assert _generate(rt) == eager
    assert rt.runner.decode_graphs.enabled and rt.runner.decode_graphs.replays >= 8


def test_a_replay_that_raises_fails_only_the_request_it_computes(tiny_llama):
    # a replayed step that raises is a failed forward: the engine splits the pass and re-runs the
    # halves, the request whose row makes it raise fails alone (a 500 abort), the other finishes
    # on graphs, and no KV slot leaks
    rt = _parts(tiny_llama, None)
    runner = rt.runner
    rows_now: list[list[int]] = []
    reqs, outs = good_and_bad_requests(PROMPTS[0], PROMPTS[1])
    bad = reqs[1]

    class RaisingReplay(RecordedStep):
        def replay(self) -> None:
            if bad.kv is not None and bad.kv.row in rows_now[-1]:
                raise RuntimeError("replay fault")
            super().replay()

    graphs = runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_pool, runner.attn_backend, runner.pad_write_slot, 8, make_graph=RaisingReplay, max_seq_len=runner.context_len)
    original = graphs.run
    graphs.run = lambda batch: (rows_now.append(batch.req_rows.tolist()), original(batch))[1]
    run_and_check_only_bad_failed(rt.scheduler, reqs, outs)
    assert graphs.enabled and graphs.replays >= 4  # the good request kept replaying its steps
