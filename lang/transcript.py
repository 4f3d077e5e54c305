"""Transcript: a program state's text and chat messages, built with a chat template's markers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.chat_template import ChatTemplate


@dataclass
class Transcript:
    """The text a program has built so far, and the chat messages inside it.

    ``template`` is fetched on the first role (plain-text programs never need one). A program
    whose first message is not a system message gets the template's ``start`` text (e.g. a
    default system prompt) first, as the template itself would render it.
    """

    template: Callable[[], ChatTemplate | None]
    text: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    role: str | None = None
    role_start: int = 0

    def append(self, text: str) -> None:
        """Append literal text."""
        self.text += text

    def begin_role(self, role: str) -> None:
        """Open a message of ``role``."""
        if self.role is not None:
            raise ValueError(f"{role}() begins while {self.role}() is still open; end {self.role} first")
        template = self._template()
        if not self.messages and role != "system" and template.start:
            self.text += template.start
            if template.default_system is not None:
                self.messages.append({"role": "system", "content": template.default_system})
        self.text += template.prefix(role)
        self.role, self.role_start = role, len(self.text)

    def end_role(self, role: str) -> None:
        """Close the open message, which must be of ``role``."""
        if self.role != role:
            raise ValueError(f"{role}_end() without a matching {role}_begin() (open: {self.role or 'none'})")
        template = self._template()
        self.messages.append({"role": role, "content": self.text[self.role_start :]})
        self.text += template.suffix(role)
        self.role = None

    def copy(self) -> Transcript:
        """An independent copy (for forks)."""
        return Transcript(self.template, self.text, [dict(m) for m in self.messages], self.role, self.role_start)

    def _template(self) -> ChatTemplate:
        template = self.template()
        if template is None:
            raise ValueError("roles need a backend to render the model's chat template")
        return template
