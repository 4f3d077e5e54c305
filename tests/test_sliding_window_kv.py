"""KV memory under sliding windows: a request on a model whose every layer slides holds only its
window (plus pages) of KV; a hybrid model (Gemma) keeps its global layers' KV whole."""

from __future__ import annotations

import random

import pytest

from helpers import TINY_WINDOW, Driver, hf_greedy_divergence, load_hf_model, make_tiny_model
from radixlm import ServerArgs
from radixlm.runtime.engine import build_parts


@pytest.fixture(scope="module")
def sliding_dirs(tmp_path_factory):
    """An all-sliding Mistral and a hybrid Gemma 2 (window 8), saved by transformers."""
    root = tmp_path_factory.mktemp("sliding")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("mistral_swa", "gemma2")}


def _long_request(path: str, page_size: int, prompt_len: int = 40, new_tokens: int = 40, **options):
    rt = build_parts(ServerArgs(model_path=path, max_total_tokens=4096, page_size=page_size, **options))
    d = Driver(rt)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 390) for _ in range(prompt_len)]
    rid = d.add(prompt, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    held = []
    while rt.scheduler.has_work():
        d.step()
        held += [r.kv.alloc_len - r.kv.dropped_len for r in rt.scheduler.running if r.kv is not None]  # owned or locked
    return prompt, d.results[rid].output_ids, held, rt


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_long_request_on_an_all_sliding_model_holds_only_its_window(page_size, sliding_dirs):
    prompt, output, held, rt = _long_request(sliding_dirs["mistral_swa"], page_size)
    assert rt.scheduler.kv_window == TINY_WINDOW
    assert held and max(held) <= TINY_WINDOW + 2 * page_size, f"held {max(held)} KV slots with a window of {TINY_WINDOW}"
    assert hf_greedy_divergence(load_hf_model(sliding_dirs["mistral_swa"]), prompt, output) is None
    rt.scheduler.check_accounting()
    assert rt.kv.allocator.available_slots() + rt.kv.tree.total_size() == rt.kv.allocator.num_slots


def test_chunked_prefill_of_a_long_prompt_slides_too(sliding_dirs):
    prompt, output, held, rt = _long_request(sliding_dirs["mistral_swa"], 1, prompt_len=64, new_tokens=8, chunked_prefill_size=16)
    assert max(held) <= 16 + TINY_WINDOW, f"held {max(held)} KV slots while prefilling 16-token chunks"
    assert hf_greedy_divergence(load_hf_model(sliding_dirs["mistral_swa"]), prompt, output) is None


def test_a_hybrid_model_keeps_its_global_layers_kv_whole(sliding_dirs):
    prompt, output, held, rt = _long_request(sliding_dirs["gemma2"], 1)
    assert rt.scheduler.kv_window is None
    assert max(held) >= len(prompt) + len(output) - 2  # the last output token never has KV


def test_a_short_prompt_is_still_cached_and_a_slid_request_caches_nothing_more(sliding_dirs):
    rt = build_parts(ServerArgs(model_path=sliding_dirs["mistral_swa"], max_total_tokens=4096))
    d = Driver(rt)
    short = [5, 6, 7, 8, 9]
    d.add(short, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    d.run()
    assert rt.kv.tree.total_size() == len(short)  # shared while it ran; its slid output is not cached
    again = d.add(short, max_new_tokens=2, temperature=0.0, ignore_eos=True)
    d.run()
    assert d.results[again].meta_info["cached_tokens"] == len(short) - 1  # all but the token whose logits are needed
