"""JSON Schema keywords no grammar can say, enforced beside the grammar while the JSON is written.

``uniqueItems``, ``oneOf`` whose branches may overlap, ``not`` of a general schema, ``if``/
``then``/``else``, ``propertyNames``, ``min``/``maxProperties`` on open objects, ``contains``
and the leftover dependency forms cannot be written as a context-free grammar (or only at a
size no backend builds). ``relax`` takes them out of the schema the grammar is built from (the
grammar then allows a superset: ``oneOf`` becomes ``anyOf``, the others are dropped) and
records where; ``SchemaChecker`` knows, for any place in a JSON document, which schemas
certainly apply there; ``SemanticMatcher`` follows the output byte by byte and, at each token
that completes a value (a string's closing quote, a number's delimiter, a container's closing
bracket), validates that value with ``jsonschema`` against every such schema that needs it.
A token after which the document can no longer be valid is refused by ``accept`` and left out
of the mask, so the output is valid whenever it ends; where nothing valid can follow, the
matcher reports an error (the request ends with it, never with invalid JSON).

Which schemas "certainly apply" follows only the keywords that pick a subschema from the
document itself (``properties``, ``patternProperties``, ``additionalProperties``, ``items``,
``prefixItems``, ``additionalItems``, ``allOf``, local ``$ref``). A relaxed keyword under a
branch (``anyOf``, ``oneOf``, ``not``, ``if``…) is checked where the branching schema's value
completes, and the root document is always validated whole: no relaxed keyword is left
unchecked. Some checks come earlier than the value's end: a duplicate array item is refused at
the item, a property name against ``propertyNames`` and the count against ``maxProperties`` at
the key.

Where the grammar leaves few tokens near a check, each is also followed through the text the
grammar then forces, so an item that could only end as a duplicate is not begun. Since what a
token may do then depends on the mask, ``accept`` decides from its state's mask.

Cost: at a mask, the allowed tokens that could complete a checked value are simulated (inside
a string, the quote tokens), plus one grammar step and rollback per token where the look-ahead applies;
validation results are cached per (schema, value text). ``benchmarks/semantic_cost.py``.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import regex
import torch
from jsonschema import ValidationError

from radixlm.runtime.constrained.base import GrammarError, Matcher, bitmask_width
from radixlm.runtime.constrained.specs import (
    in_force,
    iter_keywords,
    keyword_nodes,
    resolve_pointer,
)

# The keywords taken out of the grammar's schema and checked here instead.
RELAXED = (
    "not", "oneOf", "uniqueItems", "if", "then", "else", "propertyNames", "minProperties", "maxProperties", "contains",
    "minContains", "maxContains", "dependentSchemas", "dependencies", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
)
_BRANCHING = ("anyOf", "oneOf", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_INT64 = 2**63
_CACHE_SIZE = 4096


# ------------------------------------------------------------------ relaxing
@dataclass
class Relaxed:
    """The schema for the grammar (a superset of the original) and what was taken out."""

    schema: Any
    taken: list[tuple[str, int]] = field(default_factory=list)  # (keyword, id of the original node holding it)

    @property
    def relaxed_ids(self) -> set[int]:
        """Ids of the original schema's nodes that lost a keyword."""
        return {i for _, i in self.taken}


def relax(schema: Any, pattern_properties: bool = False) -> Relaxed:
    """``schema`` without the keywords a grammar cannot enforce (``RELAXED``, lookaround in
    patterns, integer bounds past 64 bits), as a new object; the original is left untouched
    (``SchemaChecker`` walks it).

    ``pattern_properties``: also let every object schema with ``patternProperties`` take any
    extra key with any value (its ``patternProperties`` and ``additionalProperties`` checked
    here instead), for patterns a grammar refuses because they overlap (within one schema or
    across ``allOf``)."""
    out = Relaxed(None)
    out.schema = _relax(schema, out, pattern_properties)
    # $ref targets outside the places schemas are walked (e.g. "#/ddd/x") are relaxed where they sit
    pending, done = _refs(out.schema), set()
    while pending:
        ref = pending.pop()
        if ref in done:
            continue
        done.add(ref)
        target = resolve_pointer(schema, ref[1:])
        if isinstance(target, dict) and resolve_pointer(out.schema, ref[1:]) is target:
            relaxed = _relax(target, out, pattern_properties)
            out.schema = _put(out.schema, [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p], relaxed)
            pending += _refs(relaxed)
    return out


def _refs(node: Any) -> list[str]:
    """The local ``$ref`` strings in the schema positions of ``node``."""
    refs = (holder["$ref"] for key, _, holder in keyword_nodes(node) if key == "$ref")
    return [ref for ref in refs if isinstance(ref, str) and ref.startswith("#/")]


def _put(root: Any, parts: list[str], value: Any) -> Any:
    """``root`` with ``value`` at the path ``parts``, each container on the way copied."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(root, list):
        copy_ = list(root)
        copy_[int(head)] = _put(root[int(head)], rest, value)
        return copy_
    copy_ = dict(root)
    copy_[head] = _put(root[head], rest, value)
    return copy_


def _relax(node: Any, out: Relaxed, pattern_properties: bool) -> Any:
    if not isinstance(node, dict):
        return node
    new: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            new[key] = {name: _relax(child, out, pattern_properties) for name, child in value.items()}
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            new[key] = [_relax(child, out, pattern_properties) for child in value]
        elif key in _SCHEMA_VALUES or key == "items":
            new[key] = _relax(value, out, pattern_properties)
        else:
            new[key] = value
    for key in RELAXED:
        if key not in new:
            continue
        value = new.pop(key)
        if key == "uniqueItems" and value is not True:
            continue  # uniqueItems: false asks nothing
        if key == "oneOf" and isinstance(value, list):
            if "anyOf" in new:
                new.setdefault("allOf", []).append({"anyOf": value})
            else:
                new["anyOf"] = value  # a superset: the checker asks for exactly one
        out.taken.append((key, id(node)))
    if isinstance(new.get("pattern"), str) and _LOOKAROUND.search(new["pattern"]) and _compiles(new["pattern"]):
        wider = without_lookarounds(new["pattern"])
        if wider is None:
            del new["pattern"]
        else:
            new["pattern"] = wider
        out.taken.append(("pattern", id(node)))
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = new.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= _INT64:
            del new[key]
            out.taken.append((key, id(node)))
    if pattern_properties and "patternProperties" in new:
        del new["patternProperties"]
        new.pop("additionalProperties", None)
        out.taken.append(("patternProperties", id(node)))
    return new


def _compiles(pattern: str) -> bool:
    """True when ``pattern`` is a regex Python reads (one it cannot is left for the backend to refuse)."""
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def without_lookarounds(pattern: str) -> str | None:
    """``pattern`` with its lookaround groups taken out (it then matches a superset), or None
    when it cannot be read that way."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i : j + 1])
            i = j + 1
        elif _LOOKAROUND.match(pattern, i):
            depth, j = 0, i
            while j < n:
                if pattern[j] == "\\":
                    j += 2
                    continue
                if pattern[j] == "[":
                    while j < n and pattern[j] != "]":
                        j += 2 if pattern[j] == "\\" else 1
                elif pattern[j] == "(":
                    depth += 1
                elif pattern[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if depth != 0:
                return None
            i = j + 1
            if i < n and pattern[i] in "*+?{":
                return None  # a quantified lookaround: not worth reading
        else:
            out.append(c)
            i += 1
    wider = "".join(out)
    return wider if _compiles(wider) else None


# ------------------------------------------------------------------ checking
REGEX_SECONDS = 0.05  # one pattern search on the output; past it the value is refused (fail closed)


class RegexTooSlow(Exception):
    """A schema pattern took longer than REGEX_SECONDS on a value (catastrophic backtracking)."""


def search(pattern: str, text: str) -> bool:
    """``re.search`` semantics with a time limit: a hostile pattern cannot stall the engine."""
    try:
        return regex.search(pattern, text, timeout=REGEX_SECONDS) is not None
    except TimeoutError:
        raise RegexTooSlow(pattern) from None


def _pattern(validator, pattern: str, instance: Any, schema: dict):
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns: dict, instance: Any, schema: dict):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, extra: Any, instance: Any, schema: dict):
    if not validator.is_type(instance, "object"):
        return
    declared, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in declared and not any(search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        yield ValidationError(f"additional properties {sorted(extras)!r} are not allowed")


def _time_limited(root: Any):
    """A jsonschema validator of ``root`` whose pattern keywords search with a time limit.

    ``unevaluatedProperties`` still matches ``patternProperties`` keys with Python's ``re`` inside
    jsonschema: a schema holding both is refused (GrammarError)."""
    from jsonschema import validators

    keywords = {k for k, _ in iter_keywords(root)}
    if "unevaluatedProperties" in keywords and "patternProperties" in keywords:
        raise GrammarError("json_schema: 'unevaluatedProperties' beside 'patternProperties' is not supported (their patterns could not be time-limited)")
    base = validators.validator_for(root if isinstance(root, dict) else {})
    return validators.extend(base, {"pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties})(root)


class SchemaChecker:
    """Which schemas apply where in a document, and whether a completed value satisfies them."""

    def __init__(self, root: Any, relaxed: Relaxed) -> None:
        self.root = root
        self.taken = relaxed.taken
        self._relaxed = relaxed.relaxed_ids
        self._validator = _time_limited(root)
        self.too_slow: str | None = None  # why a pattern search was cut short; every matcher then fails
        self._holds: dict[int, bool] = {}
        self._needs: dict[int, bool] = {}
        self._closure: dict[int, tuple] = {}
        self._children: dict[tuple, tuple] = {}
        self._results: OrderedDict[tuple[int, bytes], bool] = OrderedDict()
        self.validations = 0

    def describe(self) -> str:
        """The keywords checked beside the grammar, for messages."""
        return ", ".join(sorted({k for k, _ in self.taken}))

    # -- which schemas apply
    def root_nodes(self) -> tuple:
        """The schemas that apply to the whole document."""
        return self.closure(self.root)

    def closure(self, node: Any) -> tuple:
        """``node`` with every schema it brings in whole (local ``$ref`` targets, ``allOf`` members)."""
        key = id(node)
        got = self._closure.get(key)
        if got is None:
            got = self._closure[key] = tuple(n for n in in_force(self.root, node, 64) if isinstance(n, dict))
        return got

    def children(self, nodes: tuple, key: str | int) -> tuple:
        """The schemas that apply to member ``key`` (a property name or an item index) of a
        value that ``nodes`` apply to."""
        if not nodes:
            return ()
        ck = (tuple(id(n) for n in nodes), key)
        got = self._children.get(ck)
        if got is None:
            found: dict[int, Any] = {}
            for n in nodes:
                for child in self._child(n, key):
                    for c in self.closure(child):
                        found.setdefault(id(c), c)
            if len(self._children) >= _CACHE_SIZE:  # keys come from the output: keep the cache bounded
                self._children.clear()
            got = self._children[ck] = tuple(found.values())
        return got

    def _child(self, n: dict, key: str | int) -> list:
        if isinstance(key, str):
            out = []
            props = n.get("properties")
            if isinstance(props, dict) and key in props:
                out.append(props[key])
            matched = False
            pp = n.get("patternProperties")
            if isinstance(pp, dict):
                for pattern, sub in pp.items():
                    try:
                        hit = search(pattern, key)
                    except RegexTooSlow:
                        self._slow(pattern)
                        return out
                    except regex.error:
                        return out  # whether additionalProperties applies is unknown: the ancestors' checks decide
                    if hit:
                        out.append(sub)
                        matched = True
            if not out and not matched and isinstance(n.get("additionalProperties"), dict):
                out.append(n["additionalProperties"])
            return out
        prefix = n.get("prefixItems")
        items = n.get("items")
        if isinstance(prefix, list):
            if key < len(prefix):
                return [prefix[key]]
            return [items] if isinstance(items, dict) else []
        if isinstance(items, list):
            if key < len(items):
                return [items[key]]
            extra = n.get("additionalItems")
            return [extra] if isinstance(extra, dict) else []
        return [items] if isinstance(items, dict) else []

    # -- which need a check
    def needs_check(self, node: Any) -> bool:
        """True when a value ``node`` applies to must be validated against it on completion:
        it lost a keyword, or one of its branches holds a lost keyword somewhere below
        (``checks_itself``), or it is the root (the whole document is always validated)."""
        return node is self.root or self.checks_itself(node)

    def checks_itself(self, node: Any) -> bool:
        """True when ``node`` lost a keyword or one of its branches holds one somewhere below."""
        key = id(node)
        got = self._needs.get(key)
        if got is None:
            got = isinstance(node, dict) and (key in self._relaxed or self._branches_hold(node))
            self._needs[key] = got
        return got

    def checks_members(self, nodes: tuple) -> bool:
        """True when a value ``nodes`` apply to is checked as its members come (uniqueItems,
        propertyNames, maxProperties) or when it completes (``checks_itself``)."""
        return any(n.get("uniqueItems") is True or "propertyNames" in n or "maxProperties" in n or self.checks_itself(n) for n in nodes)

    def _branches_hold(self, node: dict) -> bool:
        for k in _BRANCHING:
            value = node.get(k)
            if isinstance(value, list) and any(self._holds_relaxed(v) for v in value):
                return True
            if isinstance(value, dict) and self._holds_relaxed(value):
                return True
        for k in ("dependentSchemas", "dependencies"):
            if isinstance(node.get(k), dict) and any(self._holds_relaxed(v) for v in node[k].values()):
                return True
        ref = node.get("$ref")
        return isinstance(ref, str) and not ref.startswith("#")  # not followed: checked here

    def _holds_relaxed(self, node: Any, depth: int = 0) -> bool:
        """True when a lost keyword sits in ``node`` or anywhere below it (``$ref`` followed)."""
        if not isinstance(node, dict):
            return False
        key = id(node)
        if key in self._holds:
            return self._holds[key]
        self._holds[key] = False  # a cycle adds nothing new
        found = key in self._relaxed
        children: list = []
        for k, value in node.items():
            if k in _SCHEMA_MAPS or k == "dependencies":
                if isinstance(value, dict):
                    children += value.values()
            elif k in _SCHEMA_LISTS or k == "items":
                children += value if isinstance(value, list) else [value]
            elif k in _SCHEMA_VALUES:
                children.append(value)
            elif k == "$ref" and isinstance(value, str) and value.startswith("#"):
                children.append(resolve_pointer(self.root, value[1:]))
        found = found or any(self._holds_relaxed(c, depth + 1) for c in children)
        self._holds[key] = found
        return found

    # -- validating
    def valid(self, node: Any, text: bytes, value: Any) -> bool:
        """True when ``value`` (whose JSON text is ``text``) satisfies ``node``."""
        key = (id(node), text)
        got = self._results.get(key)
        if got is None:
            self.validations += 1
            try:
                got = self._validator.evolve(schema=node).is_valid(value)
            except RegexTooSlow as exc:
                self._slow(str(exc))
                return False
            except Exception:
                got = False  # a schema jsonschema cannot evaluate, or a pattern too slow: fail closed
            self._results[key] = got
            if len(self._results) > _CACHE_SIZE:
                self._results.popitem(last=False)
        return got

    def _slow(self, pattern: str) -> None:
        self.too_slow = f"the JSON schema's pattern {pattern[:80]!r} took over {REGEX_SECONDS * 1000:g} ms on the output (catastrophic backtracking?)"

    def key_ok(self, nodes: tuple, name: str, count: int) -> bool:
        """True when an object ``nodes`` apply to may take a key ``name`` as its ``count``-th."""
        for n in nodes:
            high = n.get("maxProperties")
            if isinstance(high, int) and not isinstance(high, bool) and count > high:
                return False
            names = n.get("propertyNames")
            if names is not None and not self.valid(names, json.dumps(name).encode(), name):
                return False
        return True

    def exhausted(self, seen: _Items, nodes: tuple) -> bool:
        """True when an item ``nodes`` apply to can only take values already ``seen`` (an
        ``enum``, ``const`` or boolean item of a ``uniqueItems`` list)."""
        for n in nodes:
            if isinstance(n.get("enum"), list):
                values = n["enum"]
            elif "const" in n:
                values = [n["const"]]
            elif n.get("type") == "boolean":
                values = [True, False]
            else:
                continue
            if all(canonical(v) in seen for v in values):
                return True
        return False


def canonical(value: Any) -> str:
    """A text equal for values JSON Schema calls equal (``1`` and ``1.0``; key order ignored)."""
    return json.dumps(_normal(value), sort_keys=True, separators=(",", ":"))


def _normal(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------ following the output
_WS = frozenset(b" \t\n\r")
_DELIMS = frozenset(b",]}") | _WS
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
_OUT, _STRING, _NUMBER, _LITERAL = 0, 1, 2, 3


class _Items:
    """The items of a list under ``uniqueItems`` (canonical texts): a shared frozen part and the
    few added since, so that a copy per simulated token costs little however long the list."""

    FOLD = 32

    def __init__(self, frozen: frozenset = frozenset(), fresh: set | None = None) -> None:
        self.frozen, self.fresh = frozen, fresh if fresh is not None else set()

    def __contains__(self, item: str) -> bool:
        return item in self.fresh or item in self.frozen

    def add(self, item: str) -> None:
        self.fresh.add(item)
        if len(self.fresh) >= self.FOLD:
            self.frozen, self.fresh = self.frozen | self.fresh, set()

    def copy(self) -> _Items:
        return _Items(self.frozen, set(self.fresh))


@dataclass
class _Frame:
    """An open array or object."""

    is_object: bool
    nodes: tuple  # the schemas that apply to it
    start: int  # offset of its opening bracket
    count: int = 0  # members completed (objects: keys taken)
    key: str | None = None  # objects: the key whose value comes next
    seen: _Items | None = None  # arrays under uniqueItems: the items so far

    def copy(self) -> _Frame:
        return _Frame(self.is_object, self.nodes, self.start, self.count, self.key, None if self.seen is None else self.seen.copy())


class _Invalid(Exception):
    """The text read cannot be part of a valid document."""


class JsonFollower:
    """Reads a JSON document byte by byte and checks each value as it completes."""

    def __init__(self, checker: SchemaChecker) -> None:
        self.checker = checker
        self.text = bytearray()
        self.frames: list[_Frame] = []
        self.mode = _OUT
        self.start = 0  # where the scalar being read began
        self.is_key = False
        self.escape = False
        self.nodes: tuple = ()  # schemas of the scalar being read
        self.done = False
        self._owned: set[int] = set()  # ids of the frames only this follower holds (copy on write)

    def copy(self) -> JsonFollower:
        """An independent follower in the same state (frames are shared until one side writes)."""
        twin = JsonFollower(self.checker)
        twin.text = bytearray(self.text)
        twin.frames = list(self.frames)
        self._owned = set()
        twin.mode, twin.start, twin.is_key, twin.escape, twin.nodes, twin.done = self.mode, self.start, self.is_key, self.escape, self.nodes, self.done
        return twin

    def _top(self) -> _Frame:
        """The innermost open frame, made this follower's own to write."""
        top = self.frames[-1]
        if id(top) not in self._owned:
            top = self.frames[-1] = top.copy()
            self._owned.add(id(top))
        return top

    def feed(self, data: bytes) -> None:
        """Read ``data``; raises _Invalid (the state is then unusable: feed a copy)."""
        base = len(self.text)
        self.text += data
        for i in range(base, len(self.text)):
            self._byte(self.text[i], i)

    def end(self) -> None:
        """The document ends here: a number at the top completes; raises _Invalid."""
        if self.mode == _NUMBER:
            self._complete(len(self.text))
            self.mode = _OUT

    def member_nodes(self) -> tuple:
        """The schemas of the value that starts next here (none where a key comes first)."""
        if not self.frames:
            return self.checker.root_nodes()
        top = self.frames[-1]
        if top.is_object and top.key is None:
            return ()  # a key comes first
        return self.checker.children(top.nodes, top.key if top.is_object else top.count)

    def _byte(self, c: int, i: int) -> None:
        mode = self.mode
        if mode == _STRING:
            if self.escape:
                self.escape = False
            elif c == 0x5C:  # backslash
                self.escape = True
            elif c == 0x22:  # the closing quote
                self.mode = _OUT
                if self.is_key:
                    self._take_key(i)
                else:
                    self._complete(i + 1)
            return
        if mode == _NUMBER:
            if c not in _DELIMS:
                return
            self.mode = _OUT
            self._complete(i)
        elif mode == _LITERAL:
            if i + 1 - self.start == len(_LITERALS[self.text[self.start]]):
                self.mode = _OUT
                self._complete(i + 1)
            return
        if c in _WS or self.done:
            return
        if c == 0x7B or c == 0x5B:  # { [
            top = _Frame(c == 0x7B, self.member_nodes(), i)
            self.frames.append(top)
            self._owned.add(id(top))
            if not top.is_object and any(n.get("uniqueItems") is True for n in top.nodes):
                top.seen = _Items()
        elif c == 0x7D or c == 0x5D:  # } ]
            frame = self.frames.pop()
            self.nodes = frame.nodes
            self.start = frame.start
            self._complete(i + 1)
        elif c == 0x22:
            top = self.frames[-1] if self.frames else None
            self.is_key = top is not None and top.is_object and top.key is None
            self.mode, self.start, self.escape = _STRING, i, False
            if not self.is_key:
                self.nodes = self.member_nodes()
        elif c == 0x2C:  # ,
            top = self._top()
            if top.is_object:
                top.key = None
            elif top.seen is not None and self.checker.exhausted(top.seen, self.checker.children(top.nodes, top.count)):
                raise _Invalid  # every value the next item may take is in the list already
        elif c != 0x3A:  # : aside, a number or a literal starts
            self.start, self.nodes = i, self.member_nodes()
            self.mode = _LITERAL if c in _LITERALS else _NUMBER

    def _take_key(self, end: int) -> None:
        top = self._top()
        name = json.loads(self.text[self.start : end + 1])
        top.count += 1
        top.key = name
        if not self.checker.key_ok(top.nodes, name, top.count):
            raise _Invalid

    def _complete(self, end: int) -> None:
        """The value from ``self.start`` to ``end`` completed (its schemas are ``self.nodes``)."""
        nodes = self.nodes
        text = bytes(self.text[self.start : end])
        value = _UNREAD
        for n in nodes:
            if self.checker.needs_check(n):
                if value is _UNREAD:
                    value = json.loads(text)
                if not self.checker.valid(n, text, value):
                    raise _Invalid
        if not self.frames:
            self.done = True
            return
        top = self.frames[-1]
        if not top.is_object:
            top = self._top()
            if top.seen is not None:
                if value is _UNREAD:
                    value = json.loads(text)
                item = canonical(value)
                if item in top.seen:
                    raise _Invalid
                top.seen.add(item)
            top.count += 1


_UNREAD = object()
_LANES = np.arange(32)
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)  # set bits per byte (numpy 1.x has no bitwise_count)


# ------------------------------------------------------------------ the matcher
_SEPARATORS = frozenset(b",:") | _WS


def _closing_quote(data: bytes, escape: bool) -> int:
    """Where the first unescaped quote of ``data`` is, read inside a string (after a backslash
    when ``escape``), or -1."""
    for i, c in enumerate(data):
        if escape:
            escape = False
        elif c == 0x5C:
            escape = True
        elif c == 0x22:
            return i
    return -1


class TokenBytes:
    """Every token's bytes, and which tokens could complete a value in each reading mode."""

    def __init__(self, pieces: dict[int, bytes], vocab_size: int, end_ids: set[int]) -> None:
        self.pieces = pieces
        self.end_ids = frozenset(end_ids)
        self.vocab_size = vocab_size
        size = max(vocab_size, max(pieces, default=-1) + 1)
        quote = np.zeros(size, dtype=bool)
        delim = np.zeros(size, dtype=bool)
        letter = np.zeros(size, dtype=bool)
        starts = np.zeros(size, dtype=bool)
        for t, b in pieces.items():
            quote[t] = 0x22 in b
            delim[t] = any(c in _DELIMS for c in b)
            letter[t] = 0x65 in b or 0x6C in b  # the last letters of true, false, null
            # Outside a value, a token completes one only by closing a container, holding a
            # whole string (two quotes) or literal, or a number and its delimiter; a comma may
            # start an item no value is left for.
            starts[t] = (
                0x5D in b or 0x7D in b or 0x2C in b or b.count(0x22) >= 2 or b"true" in b or b"false" in b or b"null" in b
                or (delim[t] and any(0x30 <= c <= 0x39 for c in b))
            )
        ends = [t for t in end_ids if 0 <= t < size]
        for arr in (quote, delim, letter, starts):
            arr[ends] = True  # an end token completes a number at the top (and is checked then)
        self.size = size
        # Per reading mode: the tokens that could complete a value (the others need no check).
        self.may_complete = {_OUT: starts, _STRING: quote, _NUMBER: delim, _LITERAL: letter}
        self.completing_ids = {mode: np.flatnonzero(arr) for mode, arr in self.may_complete.items()}
        # Inside a string (after a backslash or not): the tokens that close it and then hold only
        # separators (``"``, ``",``, ``":``): they complete the string and nothing else.
        self.closes_string_only = {escape: np.zeros(size, dtype=bool) for escape in (False, True)}
        for t in self.completing_ids[_STRING].tolist():
            for escape in (False, True):
                q = _closing_quote(pieces[t], escape) if t in pieces else -1
                self.closes_string_only[escape][t] = q >= 0 and all(c in _SEPARATORS for c in pieces[t][q + 1 :])


class SemanticMatcher(Matcher):
    """A grammar matcher with the relaxed keywords checked on the values it completes.

    Where the grammar leaves few tokens (at most ``LOOKAHEAD_MAX``: an enum, a bounded number,
    the end of a required key) and a check is near (``_hot``), each is also followed along the
    text the grammar then forces
    (``forced_text``), and refused when that text completes an invalid value: a list of enum
    values under ``uniqueItems`` is not let into the one item it cannot finish. Since that
    depends on the mask, ``accept`` decides from the mask of its state (computed once per state).
    """

    LOOKAHEAD_MAX = 64

    def __init__(self, inner: Matcher, checker: SchemaChecker, vocab: TokenBytes) -> None:
        self.inner = inner
        self.checker = checker
        self.vocab = vocab
        self.follower = JsonFollower(checker)
        self._tokens: list[int] = []
        self._dead: str | None = None
        self._mask_at = -1  # len(self._tokens) when self._mask was computed
        self._mask: np.ndarray | None = None

    def _after(self, token: int) -> JsonFollower | None:
        """The follower after ``token``, or None when it makes the document invalid."""
        twin = self.follower.copy()
        try:
            if token in self.vocab.end_ids:
                twin.end()
            else:
                twin.feed(self.vocab.pieces.get(token, b""))
        except _Invalid:
            return None
        except (ValueError, IndexError, KeyError):
            return None  # not JSON the follower can read: the grammar would not take it either
        return twin

    def _refused(self, token: int, completes: bool, look_ahead: bool) -> bool:
        """True when ``token`` makes the document invalid, or (``look_ahead``) the text the
        grammar forces after it does."""
        forced = ""
        if look_ahead and token not in self.vocab.end_ids and self.inner.accept(token):  # stepped back below (a copy costs more: 6 ms for outlines)
            forced = self.inner.forced_text()
            self.inner.rollback(1)
        if not forced:
            return completes and self._after(token) is None
        twin = self.follower.copy()
        try:
            twin.feed(self.vocab.pieces.get(token, b"") + forced.encode())
        except _Invalid:
            return True
        except (ValueError, IndexError, KeyError):
            return True
        return False

    def _string_checked(self) -> bool:
        """True when completing the string being read may fail a check (its schemas, its
        list's uniqueItems, or, for a key, its object's propertyNames/maxProperties)."""
        f, checker = self.follower, self.checker
        top = f.frames[-1] if f.frames else None
        if f.is_key:
            return top is not None and any("propertyNames" in n or "maxProperties" in n for n in top.nodes)
        return any(checker.needs_check(n) for n in f.nodes) or (top is not None and top.seen is not None)

    def _hot(self) -> bool:
        """True when a check may fire within the next few values: the value being read, the
        two innermost containers or the member about to start are checked."""
        f, checker = self.follower, self.checker
        if f.mode != _OUT and any(checker.checks_itself(n) for n in f.nodes):
            return True
        if any(checker.checks_members(frame.nodes) for frame in f.frames[-2:]):
            return True
        return f.mode == _OUT and not f.done and checker.checks_members(f.member_nodes())

    def _allowed_words(self) -> np.ndarray:
        """This state's mask words (uint32), computed once per state."""
        if self._mask_at != len(self._tokens) or self._mask is None:
            scratch = torch.zeros((1, bitmask_width(self.vocab.vocab_size)), dtype=torch.int32)
            self.fill_bitmask(scratch, 0)
        return self._mask

    def accept(self, token: int) -> bool:
        """Take ``token`` when this state's mask allows it (the grammar's, less what the checks refuse)."""
        if self._dead is not None:
            return False
        words = self._allowed_words()
        if not 0 <= token < words.shape[0] * 32 or not (int(words[token >> 5]) >> (token & 31)) & 1:
            return False
        twin = self._after(token)
        if twin is None or not self.inner.accept(token):
            return False
        self.follower = twin
        self._tokens.append(token)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The grammar's mask without the tokens that would complete an invalid value."""
        self.inner.fill_bitmask(bitmask, row)
        words = bitmask[row].numpy().view(np.uint32)
        if self._dead is None and self.checker.too_slow is not None:
            self._dead = self.checker.too_slow
        if self._dead is not None:
            words[:] = 0
        elif self.inner.error() is None:
            look_ahead = int(_POPCOUNT[words.view(np.uint8)].sum()) <= self.LOOKAHEAD_MAX and self._hot()
            if look_ahead:  # few tokens: every one, followed along what the grammar then forces
                nonzero = np.flatnonzero(words)
                bits = np.unpackbits(words[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").astype(bool)
                candidates = (nonzero[:, None] * 32 + _LANES)[bits]
                candidates = candidates[candidates < self.vocab.size]
            else:  # the allowed ones among the tokens that could complete a value here
                ids = self.vocab.completing_ids[self.follower.mode]
                ids = ids[ids < words.shape[0] * 32]
                candidates = ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]
                if self.follower.mode == _STRING and not self._string_checked():
                    candidates = candidates[~self.vocab.closes_string_only[self.follower.escape][candidates]]
            completing = self.vocab.may_complete[self.follower.mode]
            refused = []
            for t in candidates.tolist():
                if self.checker.too_slow is not None:
                    break
                if (t in self.vocab.end_ids or t in self.vocab.pieces) and self._refused(t, bool(completing[t]), look_ahead):
                    refused.append(t)
            for t in refused:
                words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
            if self.checker.too_slow is not None:
                self._dead = self.checker.too_slow
                words[:] = 0
            elif refused and not words.any():
                self._dead = f"no continuation keeps the output valid under the JSON schema's {self.checker.describe()}"
        self._mask_at, self._mask = len(self._tokens), words.copy()

    def is_terminated(self) -> bool:
        """As the grammar, unless ending here would leave an invalid value (a number at the
        top, which a grammar may call finished while digits could still follow)."""
        if not self.inner.is_terminated():
            return False
        if self.follower.mode != _NUMBER:
            return True
        twin = self.follower.copy()
        try:
            twin.end()
        except (_Invalid, ValueError):
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last tokens in the grammar, and re-read the output without them."""
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._tokens[len(self._tokens) - num_tokens :]
            self.follower = JsonFollower(self.checker)
            for t in self._tokens:
                if t not in self.vocab.end_ids:
                    self.follower.feed(self.vocab.pieces.get(t, b""))
            self._dead, self._mask_at, self._mask = None, -1, None

    def forced_text(self) -> str:
        """As the grammar (drafts of it are verified through ``accept``)."""
        return self.inner.forced_text()

    def copy(self) -> SemanticMatcher:
        """An independent copy."""
        twin = SemanticMatcher(self.inner.copy(), self.checker, self.vocab)
        twin.follower, twin._tokens, twin._dead = self.follower.copy(), list(self._tokens), self._dead
        twin._mask_at, twin._mask = self._mask_at, self._mask
        return twin

    def error(self) -> str | None:
        """The grammar's error, or why no token is left (a pattern too slow ends every matcher of the schema)."""
        return self.inner.error() or self._dead or self.checker.too_slow

    def mask_needed(self) -> bool:
        """True: what this matcher takes depends on its mask (``accept`` computes it anyway)."""
        return True
