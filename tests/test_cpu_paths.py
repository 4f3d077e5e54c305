"""CPU matmul forms chosen from measured timings (``--quantization auto``, ``int4_bf16``): the
choice from fake timings, the per-machine cache, AutoLinear's numerics, the engine end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from radixlm.runtime.layers import cpu_paths
from radixlm.runtime.layers.cpu_paths import (
    AutoLinear,
    PathPlan,
    choose,
    linear_shapes,
    load_or_measure,
)
from radixlm.runtime.layers.quant import quantize_model
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear

# Timings in the shape of the measurements (ms for one pass's linears, 2 threads):
# AVX2 without fast bf16: bf16 2.6-4x slower than fp32/int4; int4 wins few rows, fp32 many.
AVX2 = {"fp32": {1: 3.9, 4: 4.1, 16: 3.5, 64: 9.0, 256: 35.0}, "bf16": {1: 9.0, 4: 12.0, 16: 20.0, 64: 35.0, 256: 147.0}, "int8": {1: 2.4, 4: 3.0, 16: 6.0, 64: 15.0, 256: 60.0}, "int4": {1: 1.2, 4: 1.9, 16: 4.6, 64: 16.6, 256: 56.0}}
# AVX-512 BF16: bf16 math fastest from 16 rows.
AVX512_BF16 = {"fp32": {1: 3.9, 4: 4.1, 16: 5.0, 64: 9.0, 256: 35.0}, "bf16": {1: 2.5, 4: 2.6, 16: 2.8, 64: 4.0, 256: 12.0}, "int8": {1: 2.4, 4: 3.0, 16: 6.0, 64: 15.0, 256: 60.0}, "int4": {1: 1.2, 4: 1.9, 16: 4.6, 64: 16.6, 256: 56.0}}


def test_the_fastest_form_is_chosen_per_row_bucket():
    avx2 = choose(AVX2)
    assert avx2.forms == ("int4", "int4", "fp32", "fp32", "fp32") and "bf16" not in avx2.used
    assert avx2.describe() == "int4 for 1-15 rows, fp32 from 16 rows"
    bf16 = choose(AVX512_BF16)
    assert bf16.forms == ("int4", "int4", "bf16", "bf16", "bf16")
    assert [bf16.form_for(r) for r in (1, 3, 4, 15, 16, 1000)] == ["int4", "int4", "int4", "int4", "bf16", "bf16"]
    assert choose(AVX2, ("int4", "bf16")).used == {"int4"}, "int4_bf16 on AVX2: the bf16 copy is never faster"
    assert choose(AVX512_BF16, ("int4", "bf16")).forms[2:] == ("bf16",) * 3
    with pytest.raises(ValueError, match="no timings"):
        choose({}, ("int4",))


def test_a_bucket_keeps_the_smaller_buckets_form_while_within_the_margin():
    close = {"int8": {1: 8.6, 4: 12.9, 16: 39.7}, "int4": {1: 9.7, 4: 12.7, 16: 36.2}, "bf16": {1: 22.1, 4: 20.3, 16: 22.3}}
    assert choose(close).forms == ("int8", "int8", "bf16"), "int4 at 4 rows is 2% faster: not worth a third copy"
    assert choose(close, margin=0.0).forms == ("int8", "int4", "bf16")


def test_int4_bf16_keeps_no_bf16_copy_where_bf16_is_slower():
    lin = nn.Linear(64, 32, bias=False)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = lin
            self.lm_head = nn.Linear(64, 16, bias=False)

    for timings, dense_from in ((AVX2, None), (AVX512_BF16, 16)):
        model = Tiny()
        quantize_model(model, "int4_bf16", plan_fn=lambda m, forms, t=timings: choose(t, forms))
        assert isinstance(model.proj, Int4Linear) and model.proj.dense_from == dense_from
        assert (model.proj.dense is None) == (dense_from is None)


def test_auto_uses_the_plain_quantized_layer_when_the_plan_is_one_of_theirs():
    from radixlm.runtime.layers.quant import _maker

    lin = nn.Linear(64, 32, bias=False)
    assert isinstance(_maker(PathPlan((1, 16), ("int8", "int8")))(lin), Int8Linear)
    plain = _maker(PathPlan((1, 4), ("int4", "int4")))(lin)
    assert isinstance(plain, Int4Linear) and plain.dense is None
    switched = _maker(PathPlan((1, 4, 16, 64), ("int4", "int4", "bf16", "bf16")))(lin)
    assert isinstance(switched, Int4Linear) and switched.dense_from == 16
    assert isinstance(_maker(PathPlan((1, 16), ("int4", "fp32")))(lin), AutoLinear)
    assert isinstance(_maker(PathPlan((1, 4, 16), ("int4", "bf16", "int4")))(lin), AutoLinear)


def test_timings_are_measured_once_per_machine_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(shapes):
        calls.append(shapes)
        return AVX2

    shapes = {(96, 64): 3}
    first, path, fresh = load_or_measure(shapes, threads=2, measure_fn=fake)
    again, same_path, fresh_again = load_or_measure(shapes, threads=2, measure_fn=fake)
    assert fresh and not fresh_again and len(calls) == 1 and path == same_path and path.is_relative_to(tmp_path)
    assert first == again == AVX2
    assert json.loads(path.read_text())["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    load_or_measure(shapes, threads=1, measure_fn=fake)
    load_or_measure({(96, 64): 4}, threads=2, measure_fn=fake)
    assert len(calls) == 3, "another thread count or other shapes: measured again"
    path.write_text("{not json")
    load_or_measure(shapes, threads=2, measure_fn=fake)
    assert len(calls) == 4, "a damaged cache entry is measured again"


def test_measure_times_every_form_at_every_row_count():
    timings = cpu_paths.measure({(48, 64): 2, (40, 96): 1}, rows=(1, 8), repeats=2)
    assert set(timings) == set(cpu_paths.FORMS)
    for form, by_rows in timings.items():
        assert set(by_rows) == {1, 8}
        assert all(0 < t < 1 for t in by_rows.values()), (form, by_rows)
    odd = cpu_paths.measure({(48, 64): 1, (8, 40): 1}, forms=("fp32", "int4"), rows=(1,), repeats=1)
    assert odd["int4"][1] == float("inf") and odd["fp32"][1] < 1, "int4 needs in_features divisible by 32: never chosen"


def test_a_form_that_cannot_run_here_is_left_out(monkeypatch):
    real = cpu_paths._form_layer

    def broken(form, weight):
        if form == "int8":
            raise RuntimeError("no int8 kernel in this build")
        return real(form, weight)

    monkeypatch.setattr(cpu_paths, "_form_layer", broken)
    timings = cpu_paths.measure({(48, 64): 1}, rows=(1, 4), repeats=1)
    assert timings["int8"] == {1: float("inf"), 4: float("inf")}
    assert "int8" not in choose(timings).used
    with pytest.raises(ValueError, match="no timings"):
        choose({"int8": timings["int8"]})


def test_auto_linear_runs_each_row_count_in_its_form():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    plan = PathPlan((1, 4, 16), ("int4", "int8", "fp32"))
    layer = AutoLinear(lin, plan)
    with torch.inference_mode():
        for rows, ref in ((2, Int4Linear(lin)), (8, Int8Linear(lin)), (32, lin)):
            x = torch.randn(rows, 64)
            want = ref(x)
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
            assert (layer(x) - lin(x)).abs().max() < 0.2
        bf16 = AutoLinear(lin, PathPlan((1,), ("bf16",)))
        x = torch.randn(3, 2, 64)
        torch.testing.assert_close(bf16(x), lin(x), atol=0.03, rtol=0.02)
        assert bf16(x).shape == (3, 2, 48) and bf16(x).dtype == torch.float32


def test_linear_shapes_count_the_tied_head():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 32)
            self.a, self.b = nn.Linear(32, 64), nn.Linear(32, 64)
            self.lm_head = None

    assert linear_shapes(Tied()) == {(64, 32): 2, (100, 32): 1}


def test_auto_quantization_serves_and_logs_its_choice(tiny_llama, tmp_path, monkeypatch, caplog):
    import logging

    import radixlm

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="radixlm.runtime.layers.cpu_paths"):
        with radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024, quantization="auto") as eng:
            out = eng.generate("The quick brown", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert len(out["output_ids"]) == 6
    assert any("CPU matmul forms" in r.getMessage() and "measured now" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "cpu_paths").glob("*.json")), "the timings are cached"
    with pytest.raises(ValueError, match="float32"):
        radixlm.Engine(model_path=tiny_llama, quantization="auto", dtype="bfloat16")
