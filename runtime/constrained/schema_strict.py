"""Strict generation: object schemas closed to the properties they declare, as OpenAI's strict
structured outputs generate them. Not an equivalence: the schema as the user wrote it stays the
one an output is valid against; this only narrows what is generated. No torch import (the
sampling parameters apply it)."""

from __future__ import annotations

import copy
from typing import Any

_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties")


def pointer(key: str) -> str:
    """``key`` escaped as one JSON-pointer segment."""
    return str(key).replace("~", "~0").replace("/", "~1")


def close_objects(schema: Any) -> Any:
    """``schema`` where each object schema that lists ``properties`` and says nothing about
    other keys gets ``additionalProperties: false``, so only declared properties are generated.

    An object schema combined with others (through ``allOf``, ``$ref`` siblings, ``if``/``then``,
    dependent schemas, ``not``, or branches of a schema with object keywords of its own) is left
    open: closing it would forbid the properties the others add.
    """
    out = copy.deepcopy(schema)
    combined: set[str] = set()
    while True:  # refs reached from combined places make their targets combined too
        found = _combined_refs(out, "", False, combined)
        if found <= combined:
            break
        combined |= found
    _close(out, "", False, combined)
    return out


def _children(node: dict, path: str, combined: bool) -> list[tuple[Any, str, bool]]:
    """``(child schema, pointer, combined?)`` for each direct subschema of ``node``."""
    own_object = any(k in node for k in _OBJECT_KEYWORDS)
    out: list[tuple[Any, str, bool]] = []
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out += [(child, f"{path}/{key}/{pointer(name)}", combined and key in ("properties", "patternProperties")) for name, child in node[key].items()]
    for key in ("dependentSchemas", "dependencies"):
        if isinstance(node.get(key), dict):
            out += [(child, f"{path}/{key}/{pointer(name)}", True) for name, child in node[key].items()]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            out += [(child, f"{path}/{key}/{i}", combined or own_object) for i, child in enumerate(node[key])]
    for key in ("allOf",):
        if isinstance(node.get(key), list):
            out += [(child, f"{path}/{key}/{i}", True) for i, child in enumerate(node[key])]
    items = node.get("items")
    if isinstance(items, list):
        out += [(child, f"{path}/items/{i}", combined) for i, child in enumerate(items)]
    elif items is not None:
        out.append((items, f"{path}/items", combined))
    if isinstance(node.get("prefixItems"), list):
        out += [(child, f"{path}/prefixItems/{i}", combined) for i, child in enumerate(node["prefixItems"])]
    for key in ("additionalProperties", "contains", "additionalItems", "unevaluatedItems"):
        if key in node:
            out.append((node[key], f"{path}/{key}", combined))
    for key in ("not", "if", "then", "else", "propertyNames", "unevaluatedProperties"):
        if key in node:
            out.append((node[key], f"{path}/{key}", True))
    return out


def _combined_refs(node: Any, path: str, combined: bool, known: set[str]) -> set[str]:
    if not isinstance(node, dict):
        return set()
    combined = combined or path in known
    found: set[str] = set()
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (combined or len(node) > 1):
        found.add(ref[1:].rstrip("/"))
    for child, sub, child_combined in _children(node, path, combined):
        found |= _combined_refs(child, sub, child_combined, known)
    return found


def _close(node: Any, path: str, combined: bool, known: set[str]) -> None:
    if not isinstance(node, dict):
        return
    combined = combined or path in known
    props = node.get("properties")
    applicators = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies", "$ref")
    if (
        not combined
        and isinstance(props, dict)
        and not any(k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", *applicators))
        and all(k in props for k in node.get("required") or [] if isinstance(k, str))
    ):
        node["additionalProperties"] = False
    for child, sub, child_combined in _children(node, path, combined):
        _close(child, sub, child_combined, known)
