"""The ``s.system()``, ``s.user()``, ``s.assistant()`` methods shared by a program's state and its tracer."""

from __future__ import annotations

from typing import Any


class RoleMethods:
    """Role helpers over the subclass's ``_role(role, expr)``: with ``expr``, append that message;
    without, a ``with`` block."""

    def system(self, expr: Any = None) -> Any:
        """Append a system message, or with no argument a ``with s.system():`` block."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        """Append a user message, or with no argument a ``with s.user():`` block."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """Append an assistant message, or with no argument a ``with s.assistant():`` block."""
        return self._role("assistant", expr)
