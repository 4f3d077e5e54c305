"""Spec helpers shared by the backends: parsing schemas, locating keywords, normalizing regexes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from radixlm.runtime.constrained.base import GrammarError

# Keywords that only annotate a schema: safe to ignore when enforcing it.
ANNOTATIONS = frozenset(
    {"title", "description", "$schema", "$id", "id", "$comment", "default", "examples", "deprecated", "readOnly", "writeOnly", "$anchor"}
)


def parse_json_schema(spec: str | dict | bool) -> dict | bool:
    """The schema as a Python object; GrammarError when it is not JSON or not a schema."""
    if isinstance(spec, (dict, bool)):
        return spec
    try:
        schema = json.loads(spec)
    except (TypeError, json.JSONDecodeError) as exc:
        raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema must be a JSON object or boolean, got {type(schema).__name__}")
    return schema


def check_refs(schema: Any) -> None:
    """Raise GrammarError for a ``$ref`` that does not resolve inside the schema."""
    for key, path in iter_keywords(schema):
        if key != "$ref":
            continue
        node = _at(schema, path)
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"json_schema: $ref {ref!r} at {path} is not a local reference (only '#/...' is supported)")
        if _at(schema, ref[1:] or "/", unescape=True) is _MISSING:
            raise GrammarError(f"json_schema: $ref {ref!r} at {path} points to nothing in the schema")


_MISSING = object()


def _at(schema: Any, pointer: str, unescape: bool = True) -> Any:
    node = schema
    for part in [p for p in pointer.split("/") if p != ""]:
        if unescape:
            part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _escape_pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def iter_keywords(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every ``(keyword, JSON pointer of the schema holding it)`` in a schema, depth first.

    Descends only into places that hold subschemas, so property *names* are not mistaken for
    keywords.
    """
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        yield key, path or "/"
        sub = f"{path}/{_escape_pointer(key)}"
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
            for name, child in value.items():
                yield from iter_keywords(child, f"{sub}/{_escape_pointer(name)}")
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            for i, child in enumerate(value):
                yield from iter_keywords(child, f"{sub}/{i}")
        elif key == "items" and isinstance(value, list):
            for i, child in enumerate(value):
                yield from iter_keywords(child, f"{sub}/{i}")
        elif key in ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems") and isinstance(value, dict):
            yield from iter_keywords(value, sub)


def locate(schema: Any, keywords: list[str]) -> list[str]:
    """``'keyword' at /pointer`` descriptions for each occurrence of the given keywords."""
    wanted = set(keywords)
    return [f"'{k}' at {p}" for k, p in iter_keywords(schema) if k in wanted]


def unsupported_error(backend: str, schema: Any, keywords: list[str]) -> GrammarError:
    """A GrammarError naming the unsupported keywords and where they sit."""
    places = locate(schema, keywords) or [f"'{k}'" for k in keywords]
    return GrammarError(f"json_schema uses keywords the {backend} backend cannot enforce: {', '.join(places[:5])}")


def normalize_regex(regex: str) -> str:
    """Rewrite ``\\d`` as ``[0-9]`` (outside classes) or ``0-9`` (inside), so digits mean ASCII."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if regex[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":  # a leading ']' is a literal
                out.append("]")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)
