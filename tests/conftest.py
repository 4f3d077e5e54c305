"""Shared fixtures: tiny random-weight models in temp dirs, the embedded SmolLM2, and helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, Triton kernels can only run in Triton's interpreter; it must be chosen before
# triton is first imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every engine the suite starts (in-process or a server child) checks its KV accounting after
# each step: a leak fails the test that caused it, not a later one.
os.environ.setdefault("RADIXLM_CHECK_ACCOUNTING", "1")

# The suite shares 2 cores with whatever else runs: one intra-op thread is faster and steadier.
os.environ.setdefault("RADIXLM_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["RADIXLM_NUM_THREADS"]))

from helpers import (  # noqa: E402
    API_KEY,
    LORA_ADAPTERS,
    TINY_ARCHS,
    built_cpp_kernels,
    make_adapter,
    make_tiny_model,
)


@pytest.fixture(scope="session")
def cpp_ext():
    """The C++ CPU kernels' module (built once per machine); skips without a compiler, fails under CI."""
    return built_cpp_kernels()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Folders holding tiny random-weight Llama, Qwen2 and Mistral checkpoints with a tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, str]) -> str:
    """Path of the tiny Llama checkpoint."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Folders of three tiny random PEFT adapters of the tiny Llama (``LORA_ADAPTERS``), by name;
    strong enough that each changes the greedy tokens."""
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_llama, root / name, r, a, t, rs, seed=i + 1) for i, (name, (r, a, t, rs)) in enumerate(LORA_ADAPTERS.items())}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF."""
    from radixlm.runtime.loader import default_model_path

    return default_model_path()


# ------------------------------------------------------------ frontend language (lang/)
@pytest.fixture(scope="session")
def lang_engine_backend(tiny_llama: str):
    """An in-process EngineBackend on the tiny Llama (output quality does not matter)."""
    from radixlm.lang.backend.engine import EngineBackend

    backend = EngineBackend(model_path=tiny_llama)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def lang_server_backend(tiny_server):
    """A RuntimeEndpoint talking to ``radixlm serve`` on the tiny Llama (the shared ``tiny_server``)."""
    from radixlm.lang.backend.endpoint import RuntimeEndpoint

    backend = RuntimeEndpoint(tiny_server.base_url)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "server"])
def lang_backend(request: pytest.FixtureRequest):
    """Each test runs once in-process and once over HTTP (the tiny Llama behind both)."""
    return request.getfixturevalue(f"lang_{request.param}_backend")


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_path: str):
    """An in-process EngineBackend on the embedded SmolLM2 (for tests where outputs must make sense)."""
    from radixlm.lang.backend.engine import EngineBackend

    backend = EngineBackend(model_path=smollm2_path)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def tiny_server(tiny_llama: str):
    """``radixlm serve`` of the tiny Llama (served as "tiny", 4096 KV tokens), shared by the session's HTTP tests."""
    from helpers import ServerProcess

    server = ServerProcess(tiny_llama, "--max-total-tokens", "4096", "--served-model-name", "tiny")
    yield server
    assert server.stop() == 0, "the shared server did not exit cleanly"


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    """An httpx client of the shared tiny-model server."""
    import httpx

    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def keyed_server(tiny_llama: str):
    """``radixlm serve`` of the tiny Llama with the API key API_KEY and the admin key ADMIN_KEY,
    both from the environment (never on argv) (served as "tiny"), shared by the session."""
    from helpers import ADMIN_KEY, ServerProcess

    server = ServerProcess(tiny_llama, "--max-total-tokens", "2048", "--served-model-name", "tiny", env={"RADIXLM_API_KEY": API_KEY, "RADIXLM_ADMIN_API_KEY": ADMIN_KEY})
    yield server
    assert server.stop() == 0, "the keyed server did not exit cleanly"


RESPONSES_STORED = 6  # the store bound of ``responses_server`` (small, so eviction shows fast)


@pytest.fixture(scope="module")
def responses_server(tiny_llama: str):
    """``radixlm serve`` of the tiny Llama with the API key API_KEY and a response store of
    RESPONSES_STORED responses (served as "tiny"), for the Responses API's tests."""
    from helpers import ServerProcess

    env = {"RADIXLM_API_KEY": API_KEY, "RADIXLM_RESPONSES_MAX_STORED": str(RESPONSES_STORED)}
    server = ServerProcess(tiny_llama, "--max-total-tokens", "4096", "--served-model-name", "tiny", env=env)
    yield server
    assert server.stop() == 0, "the Responses server did not exit cleanly"


@pytest.fixture(scope="session")
def thinker_model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's folder with a chat template that opens a reasoning section (``THINK_TEMPLATE``)."""
    import json
    import shutil

    from helpers import THINK_TEMPLATE

    folder = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder)


@pytest.fixture(scope="session")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random GPT-OSS whose tokenizer and chat template speak harmony (``helpers.make_harmony_model``)."""
    from helpers import make_harmony_model

    return make_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt_oss")


@pytest.fixture(scope="module")
def thinker_url(thinker_model: str):
    """The URL of an in-process server (no key) whose tiny model's template opens a reasoning section."""
    from helpers import ServerThread
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    engine = Engine(model_path=thinker_model, max_total_tokens=4096)
    server = ServerThread(create_app(engine, served_model_name="thinker")).start()
    yield server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path: str):
    """``radixlm serve`` of the embedded SmolLM2 in a child process (for outputs that must make sense)."""
    from helpers import ServerProcess

    server = ServerProcess(smollm2_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pooling_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 checkpoint whose tokenizer holds "yes" and "no" as single tokens
    (embeddings, and rerank/score in Qwen3-Reranker's way)."""
    from transformers import AutoTokenizer

    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny_pooling") / "qwen3")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["yes", "no"])  # ids past the trained vocabulary, inside the model's (3 spare rows)
    tok.save_pretrained(folder)
    return folder
