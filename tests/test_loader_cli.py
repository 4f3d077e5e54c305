"""Loading weights (sharded safetensors, GGUF) and the command-line interface."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radixlm.runtime.loader import load_model, load_model_config, unpermute_rope_rows

BIN = Path(sys.executable).parent


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaves the two rotary halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_undoes_the_gguf_rotary_row_order():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(w, 8), 8), w)


def test_sharded_safetensors_load_the_same_weights(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(tiny_llama) / name).read_bytes())
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a, _ = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    b, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def test_smollm2_gguf_config(smollm2_path):
    from radixlm.runtime.checkpoints.gguf import gguf_config as _gguf_config

    cfg = _gguf_config(smollm2_path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.head_dim == 64 and cfg.vocab_size == 49152


def test_missing_folder_and_unsupported_architecture_are_clear_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from radixlm.runtime.loader import resolve_model_path

        resolve_model_path(str(tmp_path / "nope"))


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, RADIXLM_NUM_THREADS="1")
    return subprocess.run([str(BIN / "radixlm"), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_help_explains_each_generate_option():
    out = _cli("generate", "--help")
    assert out.returncode == 0
    for flag in ("--max-new-tokens", "--temperature", "--model-path", "--page-size", "--chunked-prefill-size"):
        assert flag in out.stdout


def test_cli_generates_from_a_model_folder(tiny_llama):
    out = _cli("generate", "The quick brown", "--model-path", tiny_llama, "--max-new-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_python_dash_m_radixlm_works(tiny_llama):
    out = subprocess.run(
        [sys.executable, "-P", "-m", "radixlm", "generate", "Radix", "--model-path", tiny_llama, "--max-new-tokens", "3", "--stream"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr


def test_cli_reports_bad_options_without_a_traceback(tiny_llama):
    out = _cli("generate", "x", "--model-path", tiny_llama, "--temperature", "-1")
    assert out.returncode == 2
    assert "temperature" in out.stderr and "Traceback" not in out.stderr
