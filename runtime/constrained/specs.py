"""Spec helpers shared by the backends: parsing schemas, locating keywords, normalizing regexes."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.constrained.schema_strict import pointer as _escape_pointer

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


def anchors_to_pointers(schema: Any) -> Any:
    """``schema`` with each ``$ref`` to a plain-name anchor (``"#name"``, declared by
    ``$anchor: "name"`` or by an ``$id``/draft-4 ``id`` of ``"#name"``) written as the JSON
    pointer of the schema that declares it; a copy when anything changes, else ``schema``."""
    anchors: dict[str, str] = {}
    for key, path, node in keyword_nodes(schema):
        if key in ("$anchor", "$id", "id"):
            value = node.get(key)
            if not isinstance(value, str):
                continue
            if key == "$anchor":
                anchors.setdefault(value, path)
            elif value.startswith("#") and len(value) > 1 and "/" not in value:
                anchors.setdefault(value[1:], path)
    if not anchors:
        return schema
    refs = []
    for key, path, node in keyword_nodes(schema):
        ref = node.get("$ref") if key == "$ref" else None
        if isinstance(ref, str) and ref.startswith("#") and ref[1:] in anchors:
            refs.append((path, anchors[ref[1:]]))
    if not refs:
        return schema
    schema = copy.deepcopy(schema)
    for path, target in refs:
        _at(schema, path)["$ref"] = "#" + ("" if target == "/" else target)
    return schema


def check_refs(schema: Any) -> None:
    """Raise GrammarError for a ``$ref`` that does not resolve inside the schema."""
    for key, path, node in keyword_nodes(schema):
        if key != "$ref":
            continue
        ref = node.get("$ref")
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


def resolve_pointer(schema: Any, pointer: str) -> Any:
    """The part of ``schema`` at a JSON pointer (``/$defs/A``); None when it points to nothing."""
    node = _at(schema, pointer)
    return None if node is _MISSING else node


def in_force(root: Any, node: Any, limit: int) -> list[Any]:
    """``node`` and the schemas every instance valid under it must also satisfy: its local
    ``$ref`` target and ``allOf`` members, recursively, breadth first, each once, at most
    ``limit`` (a hostile schema must not make this long)."""
    found, queue, seen = [], [node], set()
    while queue and len(found) < limit:
        view = queue.pop(0)
        if isinstance(view, dict):
            if id(view) in seen:
                continue
            seen.add(id(view))
        found.append(view)
        if not isinstance(view, dict):
            continue
        ref = view.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = resolve_pointer(root, ref[1:])
            if target is not None:
                queue.append(target)
        if isinstance(view.get("allOf"), list):
            queue.extend(view["allOf"])
    return found


_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTED_SUBSCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ONE_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")


def keyword_nodes(schema: Any, path: str = "") -> list[tuple[str, str, dict]]:
    """Every ``(keyword, JSON pointer of the schema holding it, that schema)`` in a schema, depth
    first. Descends only into places that hold subschemas, so property *names* are not mistaken
    for keywords. Built in one pass (a schema of a million keywords takes about a second)."""
    out: list[tuple[str, str, dict]] = []
    _collect(schema, path, out)
    return out


def _collect(schema: Any, path: str, out: list[tuple[str, str, dict]]) -> None:
    if not isinstance(schema, dict):
        return
    where = path or "/"
    for key, value in schema.items():
        out.append((key, where, schema))
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            sub = f"{path}/{_escape_pointer(key)}"
            for name, child in value.items():
                _collect(child, f"{sub}/{_escape_pointer(name)}", out)
        elif key in _LISTED_SUBSCHEMAS and isinstance(value, list):
            sub = f"{path}/{_escape_pointer(key)}"
            for i, child in enumerate(value):
                _collect(child, f"{sub}/{i}", out)
        elif key in _ONE_SUBSCHEMA and isinstance(value, dict):
            _collect(value, f"{path}/{_escape_pointer(key)}", out)


def iter_keywords(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every ``(keyword, JSON pointer of the schema holding it)`` in a schema (``keyword_nodes``' order)."""
    for key, where, _ in keyword_nodes(schema, path):
        yield key, where


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


# A regex is refused when its expanded size (counted repetitions multiplied out) passes this:
# outlines-core builds every repetition eagerly (``a{100000}`` did not finish in 20 s) and
# llguidance's first mask for ``(a{1000}){3000}`` took 4 s on the caller's thread.
MAX_REGEX_SIZE = 20_000
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


def regex_size(regex: str) -> int:
    """An upper estimate of the pieces ``regex`` expands to once counted repetitions are unrolled."""
    frames = [[0, 0, 0]]  # per open group: size of finished alternatives, of this one, of its last atom
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        frame = frames[-1]
        atom = 1
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1
            if regex[i : i + 1] == "^":
                i += 1
            if regex[i : i + 1] == "]":
                i += 1
            while i < n and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
            i += 1
        elif c == "(":
            frames.append([0, 0, 0])
            i += 1
            if regex[i : i + 2] == "?:":
                i += 2
            continue
        elif c == ")" and len(frames) > 1:
            done = frames.pop()
            frame = frames[-1]
            atom = done[0] + done[1]
            i += 1
        elif c == "|":
            frame[0] += frame[1]
            frame[1] = frame[2] = 0
            i += 1
            continue
        elif c in "*+?":
            i += 1
            continue
        elif c == "{" and (m := _QUANTIFIER.match(regex, i)):
            low, comma, high = int(m.group(1)), m.group(2), m.group(3)
            times = max(low, int(high)) if high else low + 1 if comma else low
            frame[1] += frame[2] * (times - 1)
            frame[2] *= times
            i = m.end()
            continue
        else:
            i += 1
        frame[1] += atom
        frame[2] = atom
    return sum(f[0] + f[1] for f in frames)


def check_regex_size(regex: str, what: str = "regex") -> None:
    """Raise GrammarError when ``regex`` expands past MAX_REGEX_SIZE (or ends in a lone backslash)."""
    trailing = len(regex) - len(regex.rstrip("\\"))
    if trailing % 2:  # an escape with nothing to escape: invalid in every regex dialect
        raise GrammarError(f"{what} is invalid: it ends with a lone backslash")
    size = regex_size(regex)
    if size > MAX_REGEX_SIZE:
        raise GrammarError(f"{what} is too large: it expands to about {size:,} pieces, over the limit of {MAX_REGEX_SIZE:,} (MAX_REGEX_SIZE)")


def check_schema_patterns(schema: Any) -> None:
    """Raise GrammarError for a ``pattern`` (or ``patternProperties`` key) of a JSON schema that
    ``check_regex_size`` refuses: the backends compile those regexes lazily, at generation time,
    where a pattern too large to build would fail the request mid-way instead of refusing it."""
    for key, path, node in keyword_nodes(schema):
        if key == "pattern" and isinstance(node.get("pattern"), str):
            check_regex_size(node["pattern"], f"json_schema pattern at {path}")
        elif key == "patternProperties" and isinstance(node.get("patternProperties"), dict):
            for regex in node["patternProperties"]:
                check_regex_size(regex, f"json_schema patternProperties key {regex[:40]!r} at {path}")


def check_finite(schema: Any) -> None:
    """Raise GrammarError when no finite JSON value satisfies ``schema`` (a ``$ref`` cycle that
    every instance must take, e.g. ``{"$ref": "#"}`` or a required property referring back).

    Computes which references can be satisfied by a finite value (least fixpoint), counting a
    subschema as unsatisfiable only when sure: a ``false`` schema, an empty ``enum``, a reference
    to an unsatisfiable schema, ``allOf`` with such a member, ``anyOf``/``oneOf`` with only such
    members, an object requiring such a property, an array needing at least one such item.
    """
    refs = {node["$ref"] for key, _, node in keyword_nodes(schema) if key == "$ref" and isinstance(node["$ref"], str)}
    finite: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref in refs - finite:
            target = _at(schema, ref[1:] or "/")
            if target is not _MISSING and _satisfiable(target, finite):
                finite.add(ref)
                changed = True
    if not _satisfiable(schema, finite):
        cycle = sorted(refs - finite)
        raise GrammarError(f"json_schema has no finite instance: every value must go through the $ref cycle {cycle}")


def _satisfiable(node: Any, finite: set[str]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    if isinstance(node.get("$ref"), str) and node["$ref"] not in finite:
        return False
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return False
    if isinstance(node.get("allOf"), list) and not all(_satisfiable(s, finite) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(_satisfiable(s, finite) for s in node[key]):
            return False
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if any(name in props and not _satisfiable(props[name], finite) for name in required if isinstance(name, str)):
            return False
    if kind == "array":
        min_items = node.get("minItems", 0)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if isinstance(min_items, int) and min_items > 0:
            needed = prefix[:min_items]
            if any(not _satisfiable(s, finite) for s in needed):
                return False
            if min_items > len(prefix) and isinstance(node.get("items"), (dict, bool)) and not _satisfiable(node["items"], finite):
                return False
    return True


def lark_json(schema: Any, item: str = ",", key: str = ":") -> str:
    """A Lark ``%json`` lexeme of ``schema`` with fixed separators and no free whitespace, as the
    backends' json_schema path generates (llguidance's default inside Lark lets whitespace run on)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": item, "key_separator": key}}
    return "%json " + json.dumps(schema, ensure_ascii=False)
