"""Errors of prompt programs, and where in the user's program each call was made."""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class CallSite:
    """A line of the user's program (file, line number and source text)."""

    filename: str
    lineno: int
    line: str

    def __str__(self) -> str:
        where = f"{os.path.basename(self.filename)}:{self.lineno}"
        return f"{where} ({self.line})" if self.line else where


def caller_site() -> CallSite | None:
    """The innermost frame of the call stack outside ``radixlm.lang``."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_LANG_DIR + os.sep):
            line = linecache.getline(filename, frame.f_lineno).strip()
            return CallSite(filename, frame.f_lineno, line)
        frame = frame.f_back
    return None


class ProgramError(RuntimeError):
    """A call of a prompt program failed; the message names the call and its program line."""

    def __init__(self, call: str, site: CallSite | None, cause: BaseException | str) -> None:
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        where = f" at {site}" if site is not None else ""
        super().__init__(f"{call}{where} failed: {reason}")
        self.call, self.site, self.reason = call, site, reason
        if isinstance(cause, BaseException):
            self.__cause__ = cause

    def again(self) -> ProgramError:
        """A fresh copy to raise in another thread (keeps tracebacks from piling up)."""
        err = ProgramError(self.call, self.site, self.reason)
        err.__cause__ = self.__cause__
        return err


class StopTracing(Exception):
    """Raised inside a traced program where its text stops being the same for every call."""
