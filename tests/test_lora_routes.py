"""How a request names its LoRA adapter beyond ``/generate`` and the chat route: the DSL
(``gen(lora=...)``, ``run(lora=...)``, ``run_batch(lora=...)``, ``select``) on each of its backends,
and the Responses and Messages routes' ``model: "base:name"``. Outputs are compared with what the
Engine (or the chat route) answers under the same adapter, and with the base model's different
answer, so a request that loses its adapter on the way fails; where an output cannot be compared
(a fork's prefill, a constrained chat select), an adapter the server does not serve must come
back as the request's error, which shows that it was sent."""

from __future__ import annotations

import httpx
import pytest

import radixlm
from helpers import ServerThread
from radixlm.lang.api import assistant, function, gen, select, user
from radixlm.lang.backend.base import Backend
from radixlm.lang.backend.endpoint import RuntimeEndpoint
from radixlm.lang.backend.engine import EngineBackend
from radixlm.lang.backend.openai import OpenAI
from radixlm.lang.choices import choice_spans
from radixlm.lang.errors import ProgramError
from radixlm.runtime.entrypoints.http.server import create_app

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "The quick brown fox"
CHOICES = [" jumps over", " sleeps", " runs away"]
HI = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def engine(tiny_llama: str, lora_adapters: dict[str, str]):
    paths = [f"{name}={lora_adapters[name]}" for name in ("attn", "mlp")]
    with radixlm.Engine(
        model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16, lora_paths=paths
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def lora_server(engine):
    """An in-process server (no key) of the module's engine, its model served as "tiny"."""
    server = ServerThread(create_app(engine, served_model_name="tiny")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def backends(engine, lora_server):
    """The DSL's backends on the one engine: in process, ``/generate``, and the OpenAI routes."""
    made = {
        "engine": EngineBackend(engine),
        "endpoint": RuntimeEndpoint(lora_server.url),
        "openai": OpenAI("tiny", base_url=lora_server.url + "/v1", is_chat_model=False),
    }
    yield made
    for backend in made.values():
        backend.shutdown()


@pytest.fixture(params=["engine", "endpoint", "openai"])
def backend(request: pytest.FixtureRequest, backends):
    return backends[request.param]


def want(engine, text: str, lora: str | None) -> str:
    """The Engine's greedy text for ``text`` under ``lora``."""
    return engine.generate(text, GREEDY, lora=lora)["text"]


def test_the_adapters_change_the_greedy_text(engine):
    texts = {name: want(engine, PROMPT, name) for name in (None, "attn", "mlp")}
    assert len(set(texts.values())) == 3, texts


# ------------------------------------------------------------------ the DSL
@function
def two_gens(s, prompt=PROMPT):
    s += prompt
    s += gen("a", max_tokens=8, ignore_eos=True)
    s += gen("b", max_tokens=8, ignore_eos=True, lora="mlp")


def test_run_lora_goes_with_every_gen_and_gen_lora_overrides_it(backend, engine):
    state = two_gens.run(backend=backend, temperature=0, lora="attn")
    assert state["a"] == want(engine, PROMPT, "attn")
    assert state["b"] == want(engine, PROMPT + state["a"], "mlp")
    base = two_gens.run(backend=backend, temperature=0)
    assert base["a"] == want(engine, PROMPT, None) != state["a"]
    assert base["b"] == want(engine, PROMPT + base["a"], "mlp")
    streamed = two_gens.run(backend=backend, temperature=0, lora="attn", stream=True)
    assert (streamed["a"], streamed["b"]) == (state["a"], state["b"])


@pytest.mark.parametrize("kind", ["engine", "endpoint"])  # the OpenAI backend prefills nothing
def test_forks_prefill_their_prefix_under_the_runs_adapter(backends, kind):
    @function
    def branches(s):
        s += PROMPT
        forks = s.fork(2)  # prefills PROMPT first (global_config.enable_parallel_encoding)
        forks += gen("x", max_tokens=2)

    with pytest.raises(ProgramError, match=r"fork\(\).*'nope'"):
        branches.run(backend=backends[kind], lora="nope", temperature=0)


def test_openai_speculated_gens_send_their_adapter(backends, engine):
    spec = function(num_api_spec_tokens=24)(two_gens.func)
    state = spec.run(backend=backends["openai"], temperature=0, lora="attn")
    assert state["a"] == want(engine, PROMPT, "attn")
    assert state["b"] == want(engine, PROMPT + state["a"], "mlp")


class _Canned(OpenAI):
    """An OpenAI backend that answers every request with the tokens "x", " y", " z", " w" and
    records each request's adapter (no server)."""

    def __init__(self) -> None:
        super().__init__("tiny", base_url="http://127.0.0.1:9/v1", is_chat_model=False)
        self.loras: list[str | None] = []

    def request(self, prompt, params, *, chat=None, logprobs=None, echo=False, lora=None):
        self.loras.append(lora)
        tokens = ["x", " y", " z", " w"]
        meta = {
            "prompt_tokens": 1,
            "completion_tokens": 4,
            "cached_tokens": 0,
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [(0.0, None, t) for t in tokens],
        }
        return [{"text": "".join(tokens), "meta_info": meta}]


def test_openai_speculation_serves_no_gen_of_another_adapter():
    @function(num_api_spec_tokens=4)
    def three(s):
        s += "P"
        s += gen("a", max_tokens=1)
        s += gen("b", max_tokens=1)  # served from a's speculation: the same adapter
        s += gen("c", max_tokens=1, lora="mlp")  # another adapter: a request of its own

    backend = _Canned()
    state = three.run(backend=backend, lora="attn", temperature=0)
    backend.shutdown()
    assert [state[v] for v in "abc"] == ["x", " y", "x"]
    assert [state.get_meta_info(v)["api_spec"] for v in "abc"] == [
        "generated",
        "served",
        "generated",
    ]
    assert backend.loras == ["attn", "mlp"]


def test_run_batch_lora_goes_with_every_run(backend, engine):
    prompts = [PROMPT, "Once upon a time"]
    states = two_gens.run_batch(
        [{"prompt": p} for p in prompts], backend=backend, temperature=0, lora="attn"
    )
    assert [s["a"] for s in states] == [want(engine, p, "attn") for p in prompts]
    assert [s["b"] for s in states] == [
        want(engine, p + s["a"], "mlp") for p, s in zip(prompts, states)
    ]


def _choice_logprobs(engine, prompt: str, lora: str | None) -> list[float]:
    """The choices' token logprobs after ``prompt`` (all in one list), from the Engine under ``lora``."""
    ids = EngineBackend(engine).tokenize([prompt] + [prompt + c for c in CHOICES])
    starts = choice_spans(ids[0], ids[1:], CHOICES)
    outs = [
        engine.generate(
            input_ids=full,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=s,
            lora=lora,
        )
        for full, s in zip(ids[1:], starts)
    ]
    return [t[0] for out in outs for t in out["meta_info"]["input_token_logprobs"]]


def test_select_scores_choices_with_the_runs_adapter(backend, engine):
    @function
    def pick(s):
        s += PROMPT
        s += select("x", choices=CHOICES)
        s += select("y", choices=CHOICES, lora="mlp")
        # gen(choices=...) is a select: it keeps its lora
        s += gen("z", choices=CHOICES, lora="mlp")

    def scored(state, name: str) -> list[float]:
        return [t[0] for lps in state.get_meta_info(name)["input_token_logprobs"] for t in lps]

    tuned, base = pick.run(backend=backend, lora="attn"), pick.run(backend=backend)
    assert scored(tuned, "x") == pytest.approx(_choice_logprobs(engine, PROMPT, "attn"), abs=1e-4)
    assert scored(base, "x") == pytest.approx(_choice_logprobs(engine, PROMPT, None), abs=1e-4)
    assert scored(tuned, "x") != pytest.approx(scored(base, "x"), abs=1e-3)
    for state in (tuned, base):
        assert scored(state, "y") == pytest.approx(
            _choice_logprobs(engine, PROMPT + state["x"], "mlp"), abs=1e-4
        )
        assert scored(state, "z") == pytest.approx(
            _choice_logprobs(engine, PROMPT + state["x"] + state["y"], "mlp"), abs=1e-4
        )


def test_openai_chat_model_sends_the_adapter_as_base_colon_name(lora_server, client):
    chat = OpenAI("tiny", base_url=lora_server.url + "/v1", is_chat_model=True)

    @function
    def reply(s):
        s += user(HI[0]["content"])
        s += assistant(gen("answer", max_tokens=8, ignore_eos=True))

    def direct(model: str) -> str:
        body = {
            "model": model,
            "messages": HI,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"][
            "content"
        ]

    try:
        tuned = reply.run(backend=chat, temperature=0, lora="attn")["answer"]
        base = reply.run(backend=chat, temperature=0)["answer"]
    finally:
        chat.shutdown()
    assert tuned == direct("tiny:attn") != base == direct("tiny")


def test_openai_chat_select_and_speculated_messages_send_the_adapter(lora_server):
    chat = OpenAI("tiny", base_url=lora_server.url + "/v1", is_chat_model=True)
    completion = OpenAI("tiny", base_url=lora_server.url + "/v1", is_chat_model=False)

    @function
    def pick(s):
        s += user("Pick one")
        s += assistant(select("x", choices=CHOICES))

    @function
    def scored(s):
        s += PROMPT + select("x", choices=CHOICES)

    @function(num_api_spec_tokens=16)
    def card(s, second=None):
        s += user("Describe a person")
        s += assistant(
            "Name: "
            + gen("name", max_tokens=4, stop="\n")
            + "\nAge: "
            + gen("age", max_tokens=4, lora=second)
        )

    try:
        for prog, backend in ((pick, chat), (scored, completion), (card, chat)):
            state = prog.run(backend=backend, lora="nope", temperature=0)
            with pytest.raises(ProgramError, match="does not serve the model 'tiny:nope'"):
                state["name" if prog is card else "x"]
        # an unknown adapter is not a refused feature: the backends still score and constrain
        assert not completion.refused("prompt_logprobs") and not chat.refused("regex")
        assert (
            scored.run(backend=completion, lora="attn").get_meta_info("x")["select_method"]
            == "scored"
        )
        assert (
            pick.run(backend=chat, lora="attn").get_meta_info("x")["select_method"] == "constrained"
        )
        with pytest.raises(ProgramError, match="must share their LoRA adapter"):
            card.run(backend=chat, second="mlp", lora="attn", temperature=0)["name"]
    finally:
        chat.shutdown()
        completion.shutdown()


class _NoLora(Backend):
    """A backend whose methods take no ``lora`` (as a third-party backend written before it)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__()
        self.inner = inner

    def generate(
        self,
        text,
        sampling_params,
        *,
        return_logprob=False,
        top_logprobs_num=0,
        logprob_start_len=-1,
        return_text_in_logprobs=False,
    ):
        return self.inner.generate(text, sampling_params, return_logprob=return_logprob)

    def generate_stream(self, text, sampling_params, **logprob_options):
        yield self.generate(text, sampling_params)

    def prefill(self, input_ids, logprob_start_len):
        return self.inner.prefill(input_ids, logprob_start_len)

    def tokenize(self, texts, add_special_tokens=True):
        return self.inner.tokenize(texts, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=False):
        return self.inner.apply_chat_template(messages, add_generation_prompt)

    def flush_cache(self):
        return True

    def shutdown(self):
        pass


def test_bad_lora_values_are_refused_naming_lora(backends):
    for bad, error in ((3, TypeError), (["attn"], TypeError), ("", ValueError), ("  ", ValueError)):
        for make in (
            lambda v: gen("x", lora=v),
            lambda v: select("x", choices=["a", "b"], lora=v),
            lambda v: gen("x", choices=["a"], lora=v),
        ):
            with pytest.raises(error, match="lora"):
                make(bad)
        with pytest.raises(error, match=r"two_gens\.run: lora"):
            two_gens.run(backend=backends["engine"], lora=bad)
        with pytest.raises(error, match=r"two_gens\.run_batch: lora"):
            two_gens.run_batch([{}], backend=backends["engine"], lora=bad)
    for backend in backends.values():  # an adapter the engine does not serve
        state = two_gens.run(backend=backend, lora="nope")
        with pytest.raises(ProgramError, match="(?i)lora.*'nope'"):
            state["a"]
    no_lora = _NoLora(backends["engine"])
    with pytest.raises(ProgramError, match=r"lora='attn' needs a backend that sends LoRA adapters"):
        two_gens.run(backend=no_lora, lora="attn")["a"]
    # without lora it runs as before
    assert two_gens.run(backend=no_lora, max_new_tokens=2)["a"] is not None


# ------------------------------------------------------------------ Responses and Messages
def _chat(client, model: str) -> str:
    r = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": HI, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _responses(client, model: str) -> str:
    r = client.post(
        "/v1/responses",
        json={
            "model": model,
            "input": HI[0]["content"],
            "max_output_tokens": 8,
            "temperature": 0,
            "store": False,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return "".join(
        part["text"]
        for item in r.json()["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def _messages(client, model: str) -> str:
    r = client.post(
        "/v1/messages", json={"model": model, "messages": HI, "max_tokens": 8, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return "".join(block["text"] for block in r.json()["content"] if block["type"] == "text")


@pytest.mark.parametrize("route", [_responses, _messages], ids=["responses", "messages"])
def test_responses_and_messages_take_the_adapter_from_model(client, route):
    base = _chat(client, "tiny")
    assert route(client, "tiny") == base
    for model in ("tiny:attn", "attn", "tiny:mlp"):
        tuned = _chat(client, model)
        assert tuned != base, model
        assert route(client, model) == tuned, model


def test_an_unknown_adapter_is_refused_in_each_apis_shape(client):
    r = client.post(
        "/v1/chat/completions", json={"model": "tiny:nope", "messages": HI, "max_tokens": 2}
    )
    assert r.status_code == 400 and r.json()["param"] == "model", r.text
    r = client.post(
        "/v1/responses", json={"model": "tiny:nope", "input": "hi", "max_output_tokens": 2}
    )
    assert (
        r.status_code == 400 and r.json()["object"] == "error" and r.json()["param"] == "model"
    ), r.text
    assert "no LoRA adapter 'nope'" in r.json()["message"]
    r = client.post("/v1/messages", json={"model": "tiny:nope", "messages": HI, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", (
        r.text
    )
    assert r.json()["error"]["message"].startswith("model: no LoRA adapter 'nope'"), r.text


def test_beam_search_completions_run_under_the_models_adapter(client):
    """``/v1/completions`` with ``use_beam_search`` and ``model: "base:name"`` returns the beams of
    ``/generate``'s ``beam_width`` under that adapter (not the base model's)."""
    params = {"max_new_tokens": 6, "beam_width": 2, "temperature": 0}

    def native(lora: str | None) -> list[str]:
        body = {"text": PROMPT, "sampling_params": params, **({"lora_path": lora} if lora else {})}
        answer = client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return [beam["text"] for beam in answer.json()]

    request = {"prompt": PROMPT, "max_tokens": 6, "n": 2, "use_beam_search": True, "temperature": 0}
    answer = client.post("/v1/completions", json={**request, "model": "tiny:attn"})
    assert answer.status_code == 200, answer.text
    beams = [choice["text"] for choice in answer.json()["choices"]]
    assert beams == native("attn") and beams != native(None)
    unknown = client.post("/v1/completions", json={**request, "model": "tiny:nope"})
    assert unknown.status_code == 400 and unknown.json()["param"] == "model", unknown.text
