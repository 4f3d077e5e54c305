"""Constrained generation end to end on SmolLM2: regexes and dev-set schemas always hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

import radixlm

pytestmark = pytest.mark.slow

REGEXES = [
    ("Today's date in ISO format:", r"\d{4}-\d{2}-\d{2}"),
    ("The meeting starts at (24h time):", r"([01]\d|2[0-3]):[0-5]\d"),
    ("Call us at", r"\(\d{3}\) \d{3}-\d{4}"),
    ("International phone number:", r"\+\d{1,3} \d{3} \d{3} \d{4}"),
    ("Contact e-mail:", r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net)"),
    ("The server's IPv4 address is", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    ("My favourite primary color is", r"(red|green|blue)"),
    ("Is the sky blue? Answer:", r"(yes|no)"),
    ("A matrix as nested lists:", r"\[\[\d{1,3}(,\d{1,3}){0,3}\](,\[\d{1,3}(,\d{1,3}){0,3}\]){0,3}\]"),
    ("Some fruits as a JSON list:", r'\[("[a-z]{1,10}")(,"[a-z]{1,10}"){0,4}\]'),
    ("A number between -999999 and 999999:", r"-?\d{1,6}"),
    ("Pi to a few places:", r"-?\d{1,4}\.\d{1,3}"),
    ("A hex color code:", r"#[0-9a-f]{6}"),
    ("ZIP code:", r"\d{5}(-\d{4})?"),
    ("Website:", r"https://[a-z]{2,12}\.(com|org)(/[a-z]{1,8}){0,3}"),
    ("A random UUID:", r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    ("Full name of a famous scientist:", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"),
    ("Is water wet (true or false)?", r"(true|false)"),
    ("Settings:", r"[a-z]{1,8}=\d{1,4}(;[a-z]{1,8}=\d{1,4}){0,3}"),
    ("Describe the weather in one sentence:", r"[A-Z][a-z ]{5,60}\."),
]

SCHEMAS = json.loads((Path(__file__).parent / "data" / "jsonschemabench_sample.json").read_text())
JSON_PROMPT = "<|im_start|>user\nWrite one short example JSON value.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine():
    # fp32 weights, as the schema sample and its seeds were chosen with (as stored, the int4
    # kernels' rounding sends a few sampled outputs on other, longer paths)
    with radixlm.Engine(max_total_tokens=60000, quantization="none") as eng:
        yield eng


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_regex_output_matches(engine, temperature):
    params = [{"regex": rx, "max_new_tokens": 96, "temperature": temperature, "seed": i} for i, (_, rx) in enumerate(REGEXES)]
    outs = engine.generate([p for p, _ in REGEXES], params)
    for (prompt, rx), out in zip(REGEXES, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (prompt, out)
        assert re.fullmatch(rx, out["text"]), (rx, out["text"])
    engine.check_accounting()


@pytest.fixture(scope="module")
def dev_set_outputs(engine) -> dict[float, dict[str, dict]]:
    """Each dev-set schema's output at temperature 0 and 1, by temperature and name, from ONE batch
    of 100: the few outputs that ramble on to max_new_tokens then share their last ~120 steps
    (memory-bound, as costly at 6 rows as at 3) instead of each temperature paying them alone."""
    assert len(SCHEMAS) == 50
    names = sorted(SCHEMAS)
    runs = [(t, n) for t in (0.0, 1.0) for n in names]
    # open objects, as the sample was chosen with: strict generation closes them, which moves greedy
    # SmolLM2 onto other paths (6 of 50 ramble past the limit instead of 3); strictness has its own
    # tests (test_strict_outputs.py, test_schema_rewrite.py)
    params = [{"json_schema": SCHEMAS[n]["schema"], "json_schema_strict": False, "max_new_tokens": 192, "temperature": t, "seed": SCHEMAS[n]["seed"]} for t, n in runs]
    outs = engine.generate([JSON_PROMPT] * len(runs), params)
    engine.check_accounting()
    by_temperature: dict[float, dict[str, dict]] = {0.0: {}, 1.0: {}}
    for (t, n), out in zip(runs, outs):
        by_temperature[t][n] = out
    return by_temperature


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_dev_set_schema_output_validates(engine, dev_set_outputs, temperature):
    outs = dev_set_outputs[temperature]
    assert sorted(outs) == sorted(SCHEMAS)
    finished = 0
    for name, out in outs.items():
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue  # cut by max_new_tokens: a valid prefix, but not a whole value
        finished += 1
        jsonschema.validate(json.loads(out["text"]), SCHEMAS[name]["schema"])
    # The sample was chosen so SmolLM2 finished each within 96 tokens in one batch; another batch
    # composition changes the float rounding of the batched matmuls enough to flip a few greedy
    # near-ties into a value that rambles past the limit (3 of 50 here). Allow that, but never
    # an invalid finished output.
    assert finished >= 45, f"only {finished}/50 outputs finished"
    engine.check_accounting()


def test_constrained_and_free_requests_share_a_batch(engine):
    outs = engine.generate(
        ["My favourite primary color is", "Once upon a time", "ZIP code:"],
        [{"regex": "(red|green|blue)", "temperature": 0}, {"max_new_tokens": 8, "temperature": 0}, {"regex": r"\d{5}", "temperature": 0}],
    )
    assert outs[0]["text"] in ("red", "green", "blue")
    assert len(outs[1]["output_ids"]) == 8
    assert re.fullmatch(r"\d{5}", outs[2]["text"])


def test_max_new_tokens_still_ends_a_constrained_request(engine):
    out = engine.generate("Count:", {"regex": r"(\d ){1,100}", "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 5


def test_streaming_a_json_schema_output(engine):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    chunks = list(engine.generate("The largest city in France, as JSON:", {"json_schema": schema, "temperature": 0, "max_new_tokens": 64}, stream=True))
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(final["text"]), schema)
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": {"$ref": "#/$defs/nothing"}}, "$ref"),
        ({"json_schema": {"type": "object", "properties": {"x": {"$dynamicRef": "#/$defs/y"}}}}, "'$dynamicRef' at /properties/x"),
        ({"ebnf": "start: (("}, "ebnf"),
    ],
)
def test_bad_specs_raise_and_leave_nothing_allocated(engine, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate("x", params)
    engine.check_accounting()
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_jump_forward_gives_the_same_greedy_json_with_fewer_forward_passes(smollm2_path):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}, "is_student": {"type": "boolean"}, "languages": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "maxItems": 3}},
        "required": ["name", "age", "is_student", "languages"],
        "additionalProperties": False,
    }
    prompt = "<|im_start|>user\nDescribe a programmer as JSON.<|im_end|>\n<|im_start|>assistant\n"
    results = {}
    for disable in (False, True):
        with radixlm.Engine(model_path=smollm2_path, max_total_tokens=4096, disable_jump_forward=disable) as eng:
            before = eng.get_stats()["forward_passes"]
            out = eng.generate(prompt, {"json_schema": schema, "temperature": 0, "max_new_tokens": 96})
            results[disable] = (out["text"], eng.get_stats()["forward_passes"] - before, len(out["output_ids"]))
    (text_jf, passes_jf, _), (text_plain, passes_plain, n_plain) = results[False], results[True]
    assert text_jf == text_plain
    jsonschema.validate(json.loads(text_jf), schema)
    assert passes_plain == n_plain  # one forward pass per token without jump-forward
    assert passes_jf < passes_plain
