"""SGLang programs run by SGLang's own frontend client (``sglang.RuntimeEndpoint``) against a server.

Run by tests/test_sglang_compat_server.py in a subprocess whose PYTHONPATH holds the real
``sglang`` package (never radixlm's DSL): ``python sglang_client_program.py BASE_URL``. Prints one
JSON object: what each program produced, for the test to check.
"""

from __future__ import annotations

import json
import sys

import sglang as sgl

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}


@sgl.function
def stop_regex_prog(s):
    s += "Code: " + sgl.gen("code", max_tokens=16, regex=r"ab1cd", stop_regex=r"\d", n=1)


@sgl.function
def chat_prog(s):
    s += sgl.system("You are terse.")
    s += sgl.user("Say something.")
    s += sgl.assistant(sgl.gen("reply", max_tokens=6))


@sgl.function
def select_prog(s):
    s += "Is the sky blue? Answer: " + sgl.select("answer", choices=["yes", "no", "maybe"])


@sgl.function
def regex_prog(s):
    s += "A number: " + sgl.gen("number", max_tokens=8, regex=r"[0-9]{3}")


@sgl.function
def json_prog(s):
    s += "A person as JSON: " + sgl.gen("person", max_tokens=64, json_schema=json.dumps(SCHEMA))


@sgl.function
def fork_prog(s, mode):
    s += "Two facts.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Fact {i}: " + sgl.gen("fact", max_tokens=4, regex=r"[a-z]{4}")
    if mode == "gather_variable":
        forks.join()
        s += "Facts: " + forks[0]["fact"] + ", " + forks[1]["fact"] + "\n"
    else:
        forks.join(mode=mode)
    s += "Done: " + sgl.gen("done", max_tokens=3, regex=r"ok")


@sgl.function
def int_prog(s):
    s += "How many legs has a cat? " + sgl.gen_int("legs", max_tokens=4)


@sgl.function
def batch_prog(s, word):
    s += f"Repeat {word}: " + sgl.gen("echo", max_tokens=4, regex=word)


def main(base_url: str) -> None:
    backend = sgl.RuntimeEndpoint(base_url)
    sgl.set_default_backend(backend)
    out: dict = {}
    state = stop_regex_prog.run(temperature=0)
    out["stop_regex"] = state["code"]
    state = chat_prog.run(temperature=0)
    out["chat_messages"] = [m["role"] for m in state.messages()]
    out["chat_reply"] = state["reply"]
    out["select"] = select_prog.run()["answer"]
    out["regex"] = regex_prog.run(temperature=0)["number"]
    out["json"] = json.loads(json_prog.run(temperature=0)["person"])
    gathered = fork_prog.run(mode="gather_variable", temperature=0)
    out["fork_gather"] = {"done": gathered["done"], "text": gathered.text()}
    joined = fork_prog.run(mode="concate_and_append", temperature=0)
    out["fork_concate"] = {"done": joined["done"], "text": joined.text()}
    out["gen_int"] = int_prog.run(temperature=0)["legs"]
    states = batch_prog.run_batch([{"word": "abc"}, {"word": "xyz"}, {"word": "mno"}], temperature=0)
    out["run_batch"] = [st["echo"] for st in states]
    streamed = regex_prog.run(temperature=0, stream=True)
    out["stream_chunks"] = [chunk for chunk in streamed.text_iter("number")]
    out["stream_final"] = streamed["number"]
    backend.flush_cache()
    out["flushed"] = True
    info = backend.get_server_info()
    out["server_info_keys"] = sorted(info)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
