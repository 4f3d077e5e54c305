"""The OpenAI-compatible backend (radixlm.lang.backend.openai) against radixlm's own server."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from radixlm.lang.api import assistant, function, gen, select, system, user
from radixlm.lang.api_speculation import MessagePlan, Speculation, spec_key
from radixlm.lang.backend.openai import OpenAI, decide_chat_model
from radixlm.lang.backend.openai_params import to_request
from radixlm.lang.errors import ProgramError
from radixlm.lang.remote_calls import choices_regex, nearest_choice


@pytest.fixture(scope="module")
def chat(tiny_server):
    backend = OpenAI("tiny", base_url=tiny_server.base_url + "/v1", is_chat_model=True)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def completion(tiny_server):
    backend = OpenAI("tiny", base_url=tiny_server.base_url + "/v1", is_chat_model=False)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def raw(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="EMPTY")
    yield client
    client.close()


# ------------------------------------------------------------------ chat and completion paths
def test_chat_model_is_sent_the_programs_messages(chat, raw):
    @function
    def prog(s):
        s += system("You are terse.")
        s += user("Name a colour.")
        s += assistant(gen("answer", max_tokens=12))

    state = prog.run(backend=chat, temperature=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    direct = raw.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert state["answer"] == direct.choices[0].message.content
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == direct.usage.prompt_tokens and meta["finish_reason"]["type"] in ("stop", "length")


def test_completion_model_is_sent_the_programs_text(completion, raw):
    @function
    def prog(s):
        s += "The quick brown fox"
        s += gen("more", max_tokens=10)

    state = prog.run(backend=completion, temperature=0)
    direct = raw.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0)
    assert state["more"] == direct.choices[0].text
    assert state.text() == "The quick brown fox" + direct.choices[0].text


def test_chat_gen_outside_an_assistant_message_is_a_clear_error(chat):
    @function
    def in_user(s):
        s += user("Hi " + gen("x", max_tokens=4))

    @function
    def after_text(s):
        s += user("Hi")
        s += assistant("Sure: " + gen("x", max_tokens=4))

    with pytest.raises(ProgramError, match="inside one"):
        in_user.run(backend=chat)["x"]
    with pytest.raises(ProgramError, match="num_api_spec_tokens"):
        after_text.run(backend=chat)["x"]


def test_chat_stream_shows_the_message_as_it_is_written(chat):
    @function
    def prog(s):
        s += user("Count.")
        s += assistant(gen("n", max_tokens=10))

    whole = prog.run(backend=chat, temperature=0)["n"]
    state = prog.run(backend=chat, temperature=0, stream=True)
    assert "".join(state.text_iter("n")) == whole


# -------------------------------------------------------------- regex and JSON schema
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_regex_and_json_schema_constrain_both_paths(kind, request):
    backend = request.getfixturevalue(kind)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}

    @function
    def prog(s):
        if backend.is_chat_model:
            s += user("yes or no?")
            s += assistant(gen("yn", max_tokens=8, regex="(yes|no)"))
            s += user("json")
            s += assistant(gen("obj", max_tokens=40, json_schema=schema))
        else:
            s += "Answer yes or no: "
            s += gen("yn", max_tokens=8, regex="(yes|no)")
            s += "\nJSON: "
            s += gen("obj", max_tokens=40, json_schema=schema)

    state = prog.run(backend=backend, temperature=0)
    assert re.fullmatch("(yes|no)", state["yn"])
    assert isinstance(json.loads(state["obj"])["n"], int)


def test_extension_a_server_refuses_is_an_error_naming_it():
    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if "regex" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument supplied: regex", "type": "invalid_request_error"}})
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    backend = OpenAI("m", base_url="http://hosted.invalid/v1", is_chat_model=False, http_client=httpx.Client(transport=httpx.MockTransport(handler)), max_retries=0)

    @function
    def prog(s):
        s += "Q: "
        s += gen("plain", max_tokens=4)
        s += gen("x", max_tokens=4, regex="[0-9]+")

    state = prog.run(backend=backend)
    assert state["plain"] == "ok"
    with pytest.raises(ProgramError, match=r"refused a request using regex.*Unrecognized request argument supplied: regex"):
        state["x"]


def test_backend_without_extensions_refuses_regex_by_name_and_selects_by_generating(chat):
    plain = OpenAI("tiny", base_url=chat.base_url, is_chat_model=True, server_extensions=False)

    @function
    def constrained(s):
        s += user("Digits")
        s += assistant(gen("d", max_tokens=4, regex="[0-9]+"))

    @function
    def choose(s):
        s += user("Pick")
        s += assistant(select("c", choices=["red", "green"]))

    with pytest.raises(ProgramError, match="regex.*server_extensions=False"):
        constrained.run(backend=plain)["d"]
    state = choose.run(backend=plain, temperature=0)
    assert state["c"] in ("red", "green") and state.get_meta_info("c")["select_method"] == "generated"


def test_sampling_parameters_map_to_openai_names_and_refuse_what_has_none():
    req = to_request({"max_new_tokens": 5, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9, "seed": 3, "n": 2, "frequency_penalty": 0.1, "top_k": -1, "min_p": 0.05}, chat=False, extensions=True)
    assert req.kwargs == {"max_tokens": 5, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9, "seed": 3, "n": 2, "frequency_penalty": 0.1}
    assert req.extra_body == {"min_p": 0.05}  # top_k=-1 is neutral: not sent
    with pytest.raises(ValueError, match="stop_regex"):
        to_request({"stop_regex": "a+"}, chat=False, extensions=True)
    with pytest.raises(ValueError, match="min_p"):
        to_request({"min_p": 0.05}, chat=True, extensions=False)
    assert to_request({"json_schema": '{"type": "object"}'}, chat=True, extensions=False).kwargs["response_format"]["type"] == "json_schema"


# ---------------------------------------------------------------------------- select
def test_select_on_a_completion_model_scores_choices_like_the_native_backend(completion, lang_server_backend):
    @function
    def prog(s):
        s += "My favourite animal is the"
        s += select("pet", choices=[" cat", " dog", " horse"])

    ours = prog.run(backend=completion)
    native = prog.run(backend=lang_server_backend)
    meta = ours.get_meta_info("pet")
    assert meta["select_method"] == "scored"
    assert ours["pet"] == native["pet"]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(native.get_meta_info("pet")["normalized_prompt_logprobs"], abs=1e-3)


def test_select_on_a_chat_model_is_constrained_to_the_choices(chat):
    @function
    def prog(s):
        s += user("Pick a colour")
        s += assistant(select("c", choices=["deep red", "green (light)", "blue/grey"]))

    state = prog.run(backend=chat)
    assert state["c"] in ("deep red", "green (light)", "blue/grey")
    meta = state.get_meta_info("c")
    assert meta["select_method"] == "constrained" and meta["generated_text"] == state["c"]


# ------------------------------------------------------------------------- usage
def test_token_usage_accumulates_every_request_across_threads(completion):
    @function
    def prog(s, i):
        s += f"Item {i}:"
        s += gen("a", max_tokens=3)
        s += gen("b", max_tokens=2)

    completion.token_usage.reset()
    states = prog.run_batch([{"i": i} for i in range(6)], temperature=0, backend=completion)
    metas = [st.get_meta_info(k) for st in states for k in ("a", "b")]
    usage = completion.token_usage.snapshot()
    assert usage["requests"] == 12
    assert usage["prompt_tokens"] == sum(m["prompt_tokens"] for m in metas)
    assert usage["completion_tokens"] == sum(m["completion_tokens"] for m in metas)
    assert usage["cached_tokens"] == sum(m["cached_tokens"] for m in metas) > 0  # each "b" extends its "a"'s prompt


# ------------------------------------------------------------- num_api_spec_tokens
def test_chat_spec_writes_an_assistant_message_with_several_gens_in_one_request(chat):
    @function
    def whole(s):
        s += user("Go")
        s += assistant(gen("m", max_tokens=16))

    message = whole.run(backend=chat, temperature=0)["m"]
    sep = next(c for c in message[2:] if c not in "\\")  # a character the model writes after its first two
    head, tail = message.split(sep, 1)

    @function(num_api_spec_tokens=16)
    def split(s):
        s += user("Go")
        s += assistant(gen("a", max_tokens=16, stop=sep) + sep + gen("b", max_tokens=16))

    chat.token_usage.reset()
    state = split.run(backend=chat, temperature=0)
    assert (state["a"], state["b"]) == (head, tail)
    assert chat.token_usage.requests == 1
    assert state.messages()[-1]["content"] == message
    assert state.get_meta_info("b")["api_spec"] == "message"


def test_num_api_spec_tokens_is_a_no_op_hint_on_local_backends(lang_server_backend):
    def body(s):
        s += "A"
        s += gen("x", max_tokens=4)
        s += gen("y", max_tokens=4)

    plain = function(body).run(backend=lang_server_backend, temperature=0)
    hinted = function(num_api_spec_tokens=32)(body).run(backend=lang_server_backend, temperature=0)
    assert (plain["x"], plain["y"]) == (hinted["x"], hinted["y"])
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        function(num_api_spec_tokens=0)


FEW_SHOT = "Name: Alice\nClass: Mage\nWeapon: Staff\n\nName: Bob\nClass: Warrior\nWeapon: Sword\n\nName: Carol\nClass: Archer\nWeapon: Bow\n\n"


def _sheet(s):
    s += FEW_SHOT + "Name:"
    s += gen("name", max_tokens=8, stop="\n")
    s += "\nClass:"
    s += gen("cls", max_tokens=8, stop="\n")
    s += "\nWeapon:"
    s += gen("weapon", max_tokens=8, stop="\n")


def test_num_api_spec_tokens_sends_fewer_prompt_tokens_for_the_same_variables(smollm2_server):
    backend = OpenAI("smollm2", base_url=smollm2_server.base_url + "/v1", is_chat_model=False)
    names = ("name", "cls", "weapon")
    plain = function(_sheet).run(backend=backend, temperature=0)
    without = backend.token_usage.snapshot()
    backend.token_usage.reset()
    spec = function(num_api_spec_tokens=24)(_sheet).run(backend=backend, temperature=0)
    used = backend.token_usage.snapshot()
    assert [spec[k] for k in names] == [plain[k] for k in names]
    assert used["requests"] < without["requests"] == 3
    assert used["prompt_tokens"] < without["prompt_tokens"] / 2
    assert [spec.get_meta_info(k)["api_spec"] for k in names] == ["generated", "served", "served"]
    assert spec.text() == plain.text()


# ------------------------------------------------------------------ pure helpers
def test_speculation_serves_a_gen_up_to_its_stop_or_its_token_limit():
    spec = Speculation("P:", " ab\ncd\nef", finished=False, key=(), max_tokens=6, token_ends=[1, 3, 4, 6, 7, 9])
    assert spec.serve("P:", "\n", 8) == (" ab", {"type": "stop", "matched": "\n"})
    assert spec.serve("P: ab\n", "\n", 8) == ("cd", {"type": "stop", "matched": "\n"})
    assert spec.serve("P: ab\n", "\n", 1) == ("cd", {"type": "length", "length": 1})
    assert spec.serve("P: ab\ncd\n", None, 1) == ("ef", {"type": "length", "length": 1})
    assert spec.serve("P: ab\ncd\n", None, 3) is None  # ran out: the model may have gone on
    assert spec.serve("P: xy", "\n", 8) is None  # the program left the speculated text
    done = Speculation("P:", " ab", finished=True, key=(), max_tokens=6, token_ends=None)
    assert done.serve("P:", "\n", 8) == (" ab", {"type": "stop", "matched": None})


def test_message_plan_splits_a_message_among_its_gens():
    plan = MessagePlan()
    plan.add_text("Name:")
    plan.add_gen("name", {"stop": "\n", "temperature": 0}, "gen('name')")
    plan.add_text("\nAge:")
    plan.add_gen("age", {"temperature": 0}, "gen('age')")
    assert plan.match("Name: Bo\nAge: 3") == ["Name:", " Bo", "\nAge:", " 3"]
    assert plan.match("Title: Bo\nAge: 3") is None
    with pytest.raises(ValueError, match="share their sampling parameters"):
        plan.add_gen("z", {"temperature": 0.7}, "gen('z')")
    assert spec_key({"stop": "a", "max_new_tokens": 3, "top_p": 1}) == spec_key({"top_p": 1})


def test_choice_helpers_and_the_chat_model_rule():
    assert re.fullmatch(choices_regex(["a.b", "c|d"]), "c|d") and not re.fullmatch(choices_regex(["a.b"]), "axb")
    assert nearest_choice(" yes, sure", ["no", "yes"]) == 1 and nearest_choice("gre", ["red", "green"]) == 1
    assert decide_chat_model("gpt-4o-mini") and not decide_chat_model("gpt-3.5-turbo-instruct")
