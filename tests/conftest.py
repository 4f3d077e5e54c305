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

from helpers import API_KEY, TINY_ARCHS, built_cpp_kernels, make_tiny_model  # noqa: E402


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


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path: str):
    """``radixlm serve`` of the embedded SmolLM2 in a child process (for outputs that must make sense)."""
    from helpers import ServerProcess

    server = ServerProcess(smollm2_path)
    yield server
    server.stop()
