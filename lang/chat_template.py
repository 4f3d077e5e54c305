"""The role markers of a model's chat template, found by rendering probe conversations.

A program writes roles one piece at a time (``s += user(...)``), so it needs each role's prefix
and suffix strings rather than a whole-conversation renderer. Rendering growing conversations
with unique probe contents and diffing them gives those strings for any template that renders
a conversation as the concatenation of its messages (ChatML, Llama 3, Qwen, SmolLM2, ...):

    render([S])          = first + S + sys_suffix            (first = the system prefix)
    render([S, U])       = render([S]) + user_prefix + U + user_suffix
    render([S, U, A])    = render([S, U]) + asst_prefix + A + asst_suffix
    render([U])          = start + user_prefix + U + user_suffix   (start = BOS / default system)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PROBES = {"system": "RadixlmProbeSystem", "user": "RadixlmProbeUser", "assistant": "RadixlmProbeAssistant", "tool": "RadixlmProbeTool"}

Render = Callable[[list[dict[str, str]], bool], str]
Tokenize = Callable[[list[str], bool], list[list[int]]]


@dataclass
class ChatTemplate:
    """Role prefixes and suffixes of a chat template, and what it puts before the first message."""

    roles: dict[str, tuple[str, str]] = field(default_factory=dict)  # role -> (prefix, suffix)
    start: str = ""  # text before a first message that is not a system message
    default_system: str | None = None  # content of the system message ``start`` holds, if any
    generation_prompt: str = ""  # what add_generation_prompt appends

    def prefix(self, role: str) -> str:
        """Text that opens a message of ``role``."""
        return self._markers(role)[0]

    def suffix(self, role: str) -> str:
        """Text that closes a message of ``role``."""
        return self._markers(role)[1]

    def _markers(self, role: str) -> tuple[str, str]:
        if role in self.roles:
            return self.roles[role]
        if role == "tool" and "user" in self.roles:  # a template without tool messages
            return self.roles["user"]
        raise ValueError(f"this model's chat template has no {role!r} role (it has {', '.join(self.roles)})")

    @classmethod
    def probe(cls, render: Render, tokenize: Tokenize | None = None) -> ChatTemplate:
        """Find the markers by rendering probe conversations (see the module docstring)."""
        strip = _bos_stripper(render, tokenize)

        def show(roles: list[str], gen: bool = False) -> str:
            return strip(render([{"role": r, "content": PROBES[r]} for r in roles], gen))

        roles: dict[str, tuple[str, str]] = {}
        try:
            base = show(["system"])
            roles["system"] = _split(base, PROBES["system"])
            order = ["system"]
        except Exception:  # a template without a system role
            base, order = "", []
        for role in ("user", "assistant", "tool"):
            try:
                longer = show(order + [role])
                roles[role] = _split(_after(longer, base), PROBES[role])
            except Exception:
                if role != "tool":
                    raise
                continue
            base, order = longer, order + [role]
        with_user = show(order[: order.index("user") + 1])
        generation_prompt = _after(show(order[: order.index("user") + 1], gen=True), with_user)
        before_user = _split(show(["user"]), PROBES["user"])[0]
        start = before_user[: len(before_user) - len(roles["user"][0])] if before_user.endswith(roles["user"][0]) else ""
        default_system = None
        if start and "system" in roles:
            pre, suf = roles["system"]
            if start.startswith(pre) and start.endswith(suf) and len(start) >= len(pre) + len(suf):
                default_system = start[len(pre) : len(start) - len(suf)]
        return cls(roles, start, default_system, generation_prompt)


def _split(text: str, probe: str) -> tuple[str, str]:
    i = text.find(probe)
    if i < 0 or text.find(probe, i + 1) >= 0:
        raise ValueError(f"the chat template does not render message contents verbatim (probe {probe!r})")
    return text[:i], text[i + len(probe) :]


def _after(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("the chat template renders a conversation differently once it grows")
    return longer[len(shorter) :]


def _bos_stripper(render: Render, tokenize: Tokenize | None) -> Callable[[str], str]:
    """Drop a leading BOS the template writes when the tokenizer adds one itself (no double BOS)."""
    if tokenize is None:
        return lambda text: text
    auto = tokenize([""], True)[0]
    sample = render([{"role": "user", "content": PROBES["user"]}], False)
    if not auto or tokenize([sample], False)[0][: len(auto)] != auto:
        return lambda text: text
    heads = [sample[:k] for k in range(1, min(len(sample), 64) + 1)]
    bos = next((h for h, ids in zip(heads, tokenize(heads, False)) if ids == auto), "")
    return lambda text: text[len(bos) :] if bos and text.startswith(bos) else text
