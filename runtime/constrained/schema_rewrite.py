"""JSON-schema rewrites: keywords the grammar backends cannot enforce, turned into equivalent
forms they can, and strict generation (no undeclared properties).

``rewrite_schema`` keeps the set of valid instances exactly as it was (the property tests in
``tests/test_schema_rewrite.py`` check each rewrite both ways with ``jsonschema``):

- ``format``: a format the backend enforces stays; one we can write as an exact pattern
  (``byte``) or bounds (``int32``, ``int64``) becomes that; ``url`` means ``uri``. Any other
  format is an annotation (as the JSON Schema specification says of unknown formats): it is
  dropped and named in a warning rather than refusing the request.
- ``oneOf`` whose branches are provably mutually exclusive (distinct types, disjoint
  ``const``/``enum`` values, a required property whose values are disjoint, a required key the
  other branch forbids) is the same as ``anyOf``. Any other ``oneOf`` is left as it is (the
  llguidance backend checks it beside the grammar: ``semantic.py``).
- ``dependentRequired``, ``dependentSchemas`` and ``dependencies`` become ``anyOf`` of "the key
  is absent" and "the key is present with what it brings".
- ``not`` of a ``required`` list, of a ``type``, of ``const``/``enum`` over a finite domain (or of
  null/boolean values) becomes the positive form.
- ``minProperties``/``maxProperties`` on a closed object (``additionalProperties: false``, no
  ``patternProperties``) become an ``anyOf`` over which optional keys are present, when there
  are at most ``MAX_PROPERTY_BRANCHES`` such sets.

What cannot be rewritten is left as it was, for the backend to refuse with the keyword named.

Strict generation (no undeclared properties) is ``schema_strict.close_objects``, not a rewrite:
it narrows what is generated on purpose.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.constrained.schema_strict import pointer as _pointer
from radixlm.runtime.constrained.specs import in_force

# Exact patterns for formats no backend knows natively (anchored: JSON Schema patterns search).
FORMAT_PATTERNS = {
    "byte": r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",  # RFC 4648 base64
    "ipv4": r"^(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])$",
}
FORMAT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}  # OpenAPI integer formats
FORMAT_ALIASES = {"url": "uri"}
MAX_PROPERTY_BRANCHES = 64  # min/maxProperties: the most key sets spelled out as anyOf branches
MAX_ONE_OF_BRANCHES = 256  # oneOf: the most branches whose exclusivity is checked (pairwise)
MAX_VIEWS = 16  # oneOf: the most schemas (a branch, its $ref target, its allOf members) compared per branch

_TYPES = ("array", "boolean", "null", "number", "object", "string")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly"}


@dataclass
class Rewrite:
    """A schema rewritten for a backend, and the warnings about what it does not enforce."""

    schema: Any
    warnings: list[str] = field(default_factory=list)


def rewrite_schema(schema: Any, native_formats: frozenset[str] | set[str]) -> Rewrite:
    """``schema`` with the keywords above rewritten into equivalent enforceable forms."""
    out = Rewrite(copy.deepcopy(schema))
    _Rewriter(out, frozenset(native_formats)).walk(out.schema, "")
    return out


_JSON_LEXEME = re.compile(r"%json\s*(?=\{)")


def rewrite_lark(grammar: str, native_formats: frozenset[str] | set[str]) -> tuple[str, list[str]]:
    """A Lark grammar with each ``%json {...}`` schema rewritten (``rewrite_schema``), and the
    warnings of all of them; a schema that does not parse as JSON is left for the backend."""
    decoder = json.JSONDecoder()
    pieces, warnings, at = [], [], 0
    for m in _JSON_LEXEME.finditer(grammar):
        if m.start() < at:
            continue
        try:
            schema, end = decoder.raw_decode(grammar, m.end())
        except json.JSONDecodeError:
            continue
        rewrite = rewrite_schema(schema, native_formats)
        warnings += [w for w in rewrite.warnings if w not in warnings]
        pieces += [grammar[at : m.end()], json.dumps(rewrite.schema, ensure_ascii=False)]
        at = end
    return "".join(pieces) + grammar[at:], warnings


# ------------------------------------------------------------------- rewrites
class _Rewriter:
    def __init__(self, out: Rewrite, native: frozenset[str]) -> None:
        self.out, self.native, self.root = out, native, out.schema

    def walk(self, node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for name, child in node[key].items():
                    self.walk(child, f"{path}/{key}/{_pointer(name)}")
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, child in enumerate(node[key]):
                    self.walk(child, f"{path}/{key}/{i}")
        items = node.get("items")
        if isinstance(items, list):
            for i, child in enumerate(items):
                self.walk(child, f"{path}/items/{i}")
        else:
            self.walk(items, f"{path}/items")
        for key in _SCHEMA_VALUES:
            self.walk(node.get(key), f"{path}/{key}")
        if isinstance(node.get("dependencies"), dict):
            for name, child in node["dependencies"].items():
                self.walk(child, f"{path}/dependencies/{_pointer(name)}")
        self._format(node, path)
        self._dependencies(node)
        self._not(node)
        self._one_of(node, path)
        self._property_counts(node)

    def _format(self, node: dict, path: str) -> None:
        fmt = node.get("format")
        if not isinstance(fmt, str):
            return
        name = FORMAT_ALIASES.get(fmt, fmt)
        if name in self.native:
            node["format"] = name
            return
        del node["format"]
        if name in FORMAT_PATTERNS and "pattern" in node:
            self.out.warnings.append(f"format {fmt!r} at {path or '/'} is not enforced: it sits next to a pattern")
        elif name in FORMAT_PATTERNS:
            node["pattern"] = FORMAT_PATTERNS[name]
        elif name in FORMAT_BOUNDS:
            low, high = FORMAT_BOUNDS[name]
            node["minimum"] = max(low, node["minimum"]) if _is_number(node.get("minimum")) else low
            node["maximum"] = min(high, node["maximum"]) if _is_number(node.get("maximum")) else high
        else:
            self.out.warnings.append(f"format {fmt!r} at {path or '/'} is not enforced: the grammar backend does not know it")

    def _dependencies(self, node: dict) -> None:
        given = {k: node[k] for k in ("dependentRequired", "dependentSchemas", "dependencies") if k in node}
        if not all(isinstance(v, dict) for v in given.values()):
            return  # not a schema's form of them: left for the backend to refuse
        required = dict(given.get("dependentRequired", {}))
        schemas = dict(given.get("dependentSchemas", {}))
        for key, value in given.get("dependencies", {}).items():
            (required if isinstance(value, list) else schemas)[key] = value
        if not all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in required.values()):
            return
        if not all(isinstance(sub, (dict, bool)) for sub in schemas.values()):
            return
        for k in given:
            del node[k]
        extra = [{"anyOf": [{"properties": {k: False}}, {"required": [k, *names]}]} for k, names in required.items()]
        extra += [{"anyOf": [{"properties": {k: False}}, {"allOf": [{"required": [k]}, sub]}]} for k, sub in schemas.items()]
        _add_all_of(node, extra)

    def _not(self, node: dict) -> None:
        if "not" not in node:
            return
        neg = node["not"]
        domain = _finite_domain(node)
        values = _values(neg) if isinstance(neg, dict) and set(neg) - _ANNOTATIONS <= {"const", "enum"} else None
        if domain is not None and values is not None:
            del node["not"]
            node.pop("const", None)
            node["enum"] = [v for v in domain if not any(_json_equal(v, x) for x in values)]
            return
        positive = _negate(neg)
        if positive is not None:
            del node["not"]
            _add_all_of(node, [positive])

    def _one_of(self, node: dict, path: str) -> None:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return
        if len(branches) > MAX_ONE_OF_BRANCHES:
            raise GrammarError(f"json_schema: 'oneOf' at {path or '/'} has {len(branches)} branches: over {MAX_ONE_OF_BRANCHES}, their exclusivity is not checked")
        context = {k: node[k] for k in ("type", "required") if k in node}  # every branch's instance meets these too
        views = [[_within(v, context) for v in self._views(b)] for b in branches]
        for a, b in itertools.combinations(views, 2):
            if not any(self._disjoint_one(x, y) for x in a for y in b):
                return  # may overlap: left as it is (semantic.py checks "exactly one" beside the grammar)
        del node["oneOf"]
        if "anyOf" in node:
            _add_all_of(node, [{"anyOf": branches}])
        else:
            node["anyOf"] = branches

    def _property_counts(self, node: dict) -> None:
        if "minProperties" not in node and "maxProperties" not in node:
            return
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        low, high = node.get("minProperties", 0), node.get("maxProperties")
        closed = node.get("additionalProperties") is False and not node.get("patternProperties") and "unevaluatedProperties" not in node
        if not closed or not all(isinstance(k, str) for k in required) or not isinstance(low, int) or not (high is None or isinstance(high, int)):
            return
        need = set(required)
        optional = [k for k in props if k not in need and props[k] is not False]
        high = len(need) + len(optional) if high is None else high
        sizes = [n for n in range(len(optional) + 1) if low <= len(need) + n <= high]
        if len(sizes) == len(optional) + 1:  # every possible key set already counts right
            node.pop("minProperties", None)
            node.pop("maxProperties", None)
            return
        count = sum(math.comb(len(optional), n) for n in sizes)
        if count > MAX_PROPERTY_BRANCHES:
            return
        branches = []
        for n in sizes:
            for present in itertools.combinations(optional, n):
                branch: dict[str, Any] = {"required": sorted(need | set(present))}
                absent = [k for k in optional if k not in present]
                if absent:
                    branch["properties"] = {k: False for k in absent}
                branches.append(branch)
        node.pop("minProperties", None)
        node.pop("maxProperties", None)
        _add_all_of(node, [{"anyOf": branches} if branches else False])

    # -------------------------------------------------------- mutual exclusion
    def _disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        """True when no instance is valid under both ``a`` and ``b`` (False: not sure)."""
        return depth < 4 and any(self._disjoint_one(x, y, depth) for x in self._views(a) for y in self._views(b))

    def _views(self, node: Any) -> list[Any]:
        """``node`` and schemas every instance valid under it must also satisfy (a proof needs
        one view that works), at most MAX_VIEWS."""
        return in_force(self.root, node, MAX_VIEWS)

    def _disjoint_one(self, a: Any, b: Any, depth: int = 0) -> bool:
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = _type_set(a), _type_set(b)
        common = ta & tb
        if not common:
            return True
        va, vb = _values(a), _values(b)
        if va is not None and vb is not None and not any(_json_equal(x, y) for x in va for y in vb):
            return True
        if common <= {"object"}:
            return self._objects_disjoint(a, b, depth) or self._objects_disjoint(b, a, depth)
        return False

    def _objects_disjoint(self, a: dict, b: dict, depth: int) -> bool:
        """Both only admit objects here: a key ``a`` requires that ``b`` forbids, or a key both
        require whose values cannot agree."""
        pa = a.get("properties") if isinstance(a.get("properties"), dict) else {}
        pb = b.get("properties") if isinstance(b.get("properties"), dict) else {}
        ra = {k for k in a.get("required") or [] if isinstance(k, str)}
        rb = {k for k in b.get("required") or [] if isinstance(k, str)}
        b_closed = b.get("additionalProperties") is False and not b.get("patternProperties")
        for key in ra:
            if pb.get(key) is False or (b_closed and key not in pb):
                return True
            if key in rb and key in pa and key in pb and self._disjoint(pa[key], pb[key], depth + 1):
                return True
        return False


# ------------------------------------------------------------------- helpers
def _within(view: Any, context: dict | None) -> Any:
    """``view`` with the ``type`` and ``required`` of the schema around it added (an instance
    valid under both satisfies the result, so disjointness found there holds)."""
    if not context or not isinstance(view, dict):
        return view
    merged = dict(view)
    if "type" not in merged and "type" in context:
        merged["type"] = context["type"]
    extra = [k for k in context.get("required") or [] if isinstance(k, str)]
    if extra:
        merged["required"] = list(dict.fromkeys([*(merged.get("required") or []), *extra]))
    return merged


def _add_all_of(node: dict, schemas: list[Any]) -> None:
    if schemas:
        node["allOf"] = list(node.get("allOf") or []) + schemas


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema means it: 1 == 1.0, but true != 1."""
    if _json_type(a) != _json_type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return a == b


def _type_set(node: dict) -> set[str]:
    """The JSON types ``node`` may admit (``integer`` counted as ``number``)."""
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set(_TYPES)
    kinds = {"number" if k == "integer" else k for k in kinds}
    values = _values(node)
    if values is not None:
        kinds &= {_json_type(v) for v in values}
    branches = node.get("anyOf")
    if isinstance(branches, list) and all(isinstance(b, dict) for b in branches):
        kinds &= set().union(*(_type_set(b) for b in branches))
    return kinds


def _values(node: Any) -> list[Any] | None:
    """The values ``node`` allows by ``const``/``enum``; None when not limited to a list."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        values = [node["const"]]
        return [v for v in values if any(_json_equal(v, x) for x in node["enum"])] if isinstance(node.get("enum"), list) else values
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    branches = node.get("anyOf")
    if isinstance(branches, list) and branches:  # a rewritten oneOf of enums: the union of theirs
        each = [_values(b) for b in branches]
        if all(v is not None for v in each):
            return [v for vs in each for v in vs]  # type: ignore[union-attr]
    return None


def _finite_domain(node: dict) -> list[Any] | None:
    """Every value ``node`` can admit, when that is a short finite list (its enum or null/boolean type)."""
    values = _values(node)
    if values is not None:
        return values
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if kinds is not None and kinds <= {"null", "boolean"}:
        return ([None] if "null" in kinds else []) + ([False, True] if "boolean" in kinds else [])
    return None


def _negate(neg: Any) -> Any:
    """A schema admitting exactly what ``neg`` rejects, for the simple forms; else None."""
    if isinstance(neg, bool):
        return not neg
    if not isinstance(neg, dict):
        return None
    keys = set(neg) - _ANNOTATIONS
    if keys == {"required"} and isinstance(neg["required"], list) and all(isinstance(k, str) for k in neg["required"]):
        names = list(dict.fromkeys(neg["required"]))
        if not names:
            return False  # every value satisfies an empty required list
        branches = [{"properties": {k: False}} for k in names]
        return {"type": "object", **({"anyOf": branches} if len(branches) > 1 else branches[0])}
    if keys == {"type"}:
        kinds = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"]) if isinstance(neg["type"], list) else None
        if kinds is None or ("integer" in kinds and "number" not in kinds):
            return None  # "not an integer" includes 1.5: no type list says that
        rest = [k for k in _TYPES if k not in kinds and not (k == "number" and "integer" in kinds)]
        return {"type": rest} if rest else False
    if keys <= {"const", "enum"} and keys:
        values = _values(neg) or []
        if not all(v is None or isinstance(v, bool) for v in values):
            return None
        left = [v for v in (None, False, True) if not any(_json_equal(v, x) for x in values)]
        others: dict[str, Any] = {"type": ["array", "number", "object", "string"]}
        return {"anyOf": [others, {"enum": left}]} if left else others
    return None
