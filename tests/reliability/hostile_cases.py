"""Issue 32's hostile requests, for the malformed corpus (test_server_malformed.py): counts,
sizes, values past what float32 logits, int64 or the context can hold, encodings a browser sends
cross-site, foreign hosts and origins, bad queries, wrong methods and unknown routes. Every case
is invalid: each must get an OpenAI-shaped 4xx."""

from __future__ import annotations

import json

MSG = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}
GEN_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def _body(route: str, **extra) -> dict:
    """A valid minimal body of ``route`` with ``extra`` sampling fields in the route's own place."""
    if route == "/generate":
        return {"text": "x", "sampling_params": {"max_new_tokens": 1, **extra}}
    if route == "/v1/completions":
        return {"prompt": "x", "max_tokens": 1, **extra}
    return {"messages": MSG, "max_tokens": 1, **extra}


Case = tuple[str, str, bytes, dict]  # method, path, body, headers


def _post(path: str, body: object, headers: dict | None = None) -> Case:
    return ("POST", path, json.dumps(body).encode(), {**JSON, **(headers or {})})


def _count_cases() -> list[Case]:
    """Counts: n, batch lists, stops, stop ids, logit_bias, tools, messages, parts, rids."""
    cases: list[Case] = []
    for n in (0, -1, 129, 1000, 3_000_000, 2**31, 2**63, 2**64, 10**30):
        cases.append(_post("/generate", {"text": "x", "sampling_params": {"n": n, "max_new_tokens": 1}}))
        cases.append(_post("/generate", {"text": ["x", "y"], "sampling_params": [{"n": n}, {"n": 1}]}))
        cases.append(_post("/v1/completions", _body("/v1/completions", n=n)))
        cases.append(_post("/v1/chat/completions", _body("/v1/chat/completions", n=n)))
    for size in (1153, 5000, 20_000):
        cases.append(_post("/generate", {"text": ["x"] * size, "sampling_params": {"max_new_tokens": 1}}))
        cases.append(_post("/generate", {"input_ids": [[5]] * size, "sampling_params": {"max_new_tokens": 1}}))
        cases.append(_post("/v1/completions", {"prompt": ["x"] * size, "max_tokens": 1}))
        cases.append(_post("/v1/completions", {"prompt": [[5]] * size, "max_tokens": 1}))
        cases.append(_post("/tokenize", {"prompt": ["x"] * size}))
    for stops in (33, 100, 10_000):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, stop=[f"s{i}" for i in range(stops)])))
    for length in (257, 10_000, 200_000):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, stop=["z" * length])))
    for ids in (1025, 100_000):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, stop_token_ids=list(range(ids)))))
    for entries in (301, 5000, 20_000):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, logit_bias={str(i): 1 for i in range(entries)})))
    for rx in (33, 200):
        cases.append(_post("/generate", _body("/generate", stop_regex=[f"a{i}" for i in range(rx)])))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for count in (513, 5000):
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "tools": [tool] * count}))
        cases.append(_post("/apply_chat_template", {"messages": MSG, "tools": [tool] * count}))
    for count in (4097, 20_000):
        cases.append(_post("/v1/chat/completions", {"messages": MSG * count}))
        cases.append(_post("/apply_chat_template", {"messages": MSG * count}))
    cases.append(_post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]}))
    cases.append(_post("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * 513}]}))
    for rids in ([], ["a"], ["a", "a"], ["a"] * 3):
        cases.append(_post("/generate", {"text": ["x", "y"], "rid": rids}))
    for room in (-1, 2**63, 2**64, "1", 1.5):
        cases.append(_post("/generate", {"text": "x", "bootstrap_room": room}))
    return cases


def _value_cases() -> list[Case]:
    """Values past what a float32 logit, an int64 or the context can hold, on every route."""
    cases: list[Case] = []
    hostile = {
        "logit_bias": [{"5": 1e39}, {"5": -1e39}, {"5": 101}, {"5": -100.5}, {"5": 1e308}, {"-1": 1}, {"99999999": 1}, {"x": 1}, {"5": "1"}, {"5": None}],
        "repetition_penalty": [1e-45, 0, -1, 0.001, 2.5, 1e308],
        "temperature": [-1e-45, -1],  # (any temperature >= 0 is SGLang's; the OpenAI routes' cap: below)
        "top_p": [0, -0.5, 1.0000001, 1e308],
        "min_p": [-1e-9, 1.5],
        "top_k": [-2, 2**31, 2**63, 10**30],
        "frequency_penalty": [2.1, -2.1, 1e308],
        "presence_penalty": [2.1, -1e308],
        "seed": [2**64, -(2**63) - 1, 10**40],
        "stop_token_ids": [[-1], [2**63], [10**9], [1.5], ["1"]],
        "min_tokens": [10**9, -1],
    }
    native_names = {"min_tokens": "min_new_tokens"}
    for name, values in hostile.items():
        for v in values:
            cases.append(_post("/generate", _body("/generate", **{native_names.get(name, name): v})))
            cases.append(_post("/v1/completions", _body("/v1/completions", **{name: v})))
            cases.append(_post("/v1/chat/completions", _body("/v1/chat/completions", **{name: v})))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "top_k", "seed"):
        for v in (float("nan"), float("inf"), float("-inf")):  # json.dumps writes NaN/Infinity: not JSON
            for route in GEN_ROUTES:
                cases.append(_post(route, _body(route, **{name: v})))
    for v in ("", [""], [1], [None], [["a"]], {"a": 1}):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, stop=v)))
    for key in ("1.5", " ", "0x5", "1e3", ""):
        for route in GEN_ROUTES:
            cases.append(_post(route, _body(route, logit_bias={key: 1})))
    for big in (2**31, 2**63, 2**64, 10**30, 10**9):
        cases.append(_post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": big}}))
        cases.append(_post("/v1/completions", {"prompt": "x", "max_tokens": big}))
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "max_tokens": big}))
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": big}))
    for logprobs in (21, 2**63, -1):
        cases.append(_post("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": logprobs}))
        cases.append(_post("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": logprobs}))
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "logprobs": True, "top_logprobs": logprobs}))
    for pattern in ("^a{1000000}$", "(a{1000}){1000}", "(?<=a", "a{2,1}", "(unclosed", "\\"):
        cases.append(_post("/generate", _body("/generate", json_schema=json.dumps({"type": "string", "pattern": pattern}))))
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": pattern}}}}))
        cases.append(_post("/generate", _body("/generate", regex=pattern)))
    cases.append(_post("/generate", _body("/generate", stop=[f"s{i}" for i in range(200_000)])))  # the case
    for t in (1e308, 2.0001e3, 2.01):  # over OpenAI's 2
        cases.append(_post("/v1/completions", _body("/v1/completions", temperature=t)))
        cases.append(_post("/v1/chat/completions", _body("/v1/chat/completions", temperature=t)))
    for ids in ([2**63], [-1], [10**9], [1.5], [[1], 2]):
        cases.append(_post("/generate", {"input_ids": ids}))
        cases.append(_post("/v1/completions", {"prompt": ids}))
    for text in ("word " * 5000, "x" * 1_000_000):
        cases.append(_post("/generate", {"text": text}))
        cases.append(_post("/v1/completions", {"prompt": text, "max_tokens": 1}))
        cases.append(_post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}))
        cases.append(_post("/tokenize", {"prompt": text * 8}))
    for label in ("", "x" * 257):
        for field in ("program", "prompt_cache_key"):
            cases.append(_post("/generate", {"text": "x", field: label}))
    for ttl in (0, -1, 86401, 1e308, "1"):
        cases.append(_post("/generate", {"text": "x", "cache_ttl": ttl}))
    for salt in ("", 5, [], {}):
        cases.append(_post("/generate", {"text": "x", "cache_salt": salt}))
        cases.append(_post("/abort_request", {"rid": "r", "cache_salt": salt}))
    for rid in ("", 5, None, [], {}, ["a"]):
        cases.append(_post("/abort_request", {"rid": rid}))
    cases.append(_post("/abort_request", {"rid": "r", "extra": 1}))
    for body in ({}, {"src_rids": []}, {"src_rids": ["a"], "dst_rid": "a"}, {"src_rids": ["a", "a"], "dst_rid": "b"}, {"src_rids": [1], "dst_rid": "b"}, {"src_rids": ["a"], "dst_rid": "b", "x": 1}):
        cases.append(_post("/concate_and_append_request", body))
    for prediction in ({"type": "other", "content": "x"}, {"type": "content"}, {"type": "content", "content": 5}, 5, []):
        cases.append(_post("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "prediction": prediction}))
    return cases


def _encoding_cases() -> list[Case]:
    """Bodies a browser could send cross-site, bad encodings and raw garbage, on every route."""
    cases: list[Case] = []
    routes = [*GEN_ROUTES, "/abort_request", "/tokenize", "/apply_chat_template", "/concate_and_append_request", "/flush_cache"]
    good = json.dumps({"text": "x", "prompt": "x", "messages": MSG, "rid": "r"}).encode()
    for path in routes:
        for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=z", "application/xml", "text/html", "", "json", "application/jsonp"):
            headers = {"content-type": ctype} if ctype else {}
            cases.append(("POST", path, good, headers))
        for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example", "http://localhost:1"):
            cases.append(("POST", path, good, {**JSON, "origin": origin}))
        for host in ("evil.example", "rebind.attacker.test:30000", "localhost.evil.example", "127.0.0.1.nip.io"):
            cases.append(("POST", path, good, {**JSON, "host": host}))
            cases.append(("GET", "/dashboard/state", b"", {"host": host}))
        for raw in (b"\xff\xfe{", b"\xef\xbb\xbf{}", b"{" * 10, b"[" * 1000 + b"]" * 1000, b'{"text": "\\ud800"}', b'{"a": NaN}', b'{"a": Infinity}', b"\x00" * 100, b"null"):
            if path in ("/flush_cache",):
                continue
            cases.append(("POST", path, raw, JSON))
    for path in ("/cache_explanations", "/dashboard/state"):
        for query in ("last=-1", "last=1001", "last=x", "last=1e3", "max_nodes=0", "max_nodes=999999", "max_nodes=-5", "since=nan", "since=inf", "since=x"):
            if path == "/cache_explanations" and not query.startswith("last"):
                continue
            if path == "/dashboard/state" and query.startswith("last"):
                continue
            cases.append(("GET", f"{path}?{query}", b"", {}))
    for method, path in (("GET", "/generate"), ("PUT", "/generate"), ("DELETE", "/v1/completions"), ("PATCH", "/v1/chat/completions"), ("GET", "/abort_request"), ("GET", "/flush_cache"), ("POST", "/health"), ("POST", "/v1/models")):
        cases.append((method, path, b"", {}))
    for path in ("/nope", "/v1/nope", "/v2/completions", "/generate/", "/../etc/passwd", "/%00", "/v1/embeddings"):
        cases.append(("GET", path, b"", {}))
        cases.append(("POST", path, b"{}", JSON))
    return cases


HOSTILE_CASES: list[Case] = _count_cases() + _value_cases() + _encoding_cases()
