"""The outlines compile worker: a separate process that builds token indexes and character FSMs.

Run as a script by ``runtime/constrained/workers.py`` (``python -P outlines_worker.py RFD WFD``),
so it imports only outlines-core and interegular, never the radixlm package (start-up stays
cheap). The first message is the vocabulary ``(eos_id, {bytes: [ids]})``, built once per worker;
each later message is a regex, answered with ``("ok", (index, fsm_tables))`` or ``("error", text)``.
A build that overruns its deadline is ended by killing this process, which is why it is one.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def char_fsm_tables(regex: str) -> tuple | None:
    """interegular's character DFA of ``regex`` as plain data, or None when it cannot parse it.

    ``(initial, finals, transitions, symbol_of_char, other_symbol, single_char_of_symbol)``:
    ``other_symbol`` stands for every character outside the alphabet (None if none may follow),
    ``single_char_of_symbol`` lists the symbols that stand for exactly one character.
    """
    try:
        import interegular

        fsm = interegular.parse_pattern(regex).to_fsm()
    except Exception:
        return None
    other = interegular.fsm.anything_else
    symbol_of: dict[str, int] = {}
    other_symbol = None
    single: dict[int, str] = {}
    for sym, chars in fsm.alphabet.by_transition.items():
        for ch in chars:
            if ch is other:
                other_symbol = sym
            else:
                symbol_of[ch] = sym
        if len(chars) == 1 and chars[0] is not other:
            single[sym] = chars[0]
    transitions = {state: dict(exits) for state, exits in fsm.map.items()}
    return fsm.initial, frozenset(fsm.finals), transitions, symbol_of, other_symbol, single


def _exit_with_parent() -> None:
    """End this process once the parent is gone (a stuck build would otherwise outlive it)."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def serve(read_fd: int, write_fd: int) -> None:
    """Answer build requests on the two pipe ends until the parent closes them."""
    from multiprocessing.connection import Connection

    import outlines_core

    threading.Thread(target=_exit_with_parent, daemon=True).start()
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    eos, groups = inbox.recv()
    vocabulary = outlines_core.Vocabulary(eos, groups)
    outbox.send(("ready", None))
    while True:
        try:
            regex = inbox.recv()
        except EOFError:
            return
        try:
            # outlines-core's automaton otherwise stops at the first point where the regex has
            # matched (e.g. after "a.bc" for [a-z.]+\.[a-z]{2}), refusing valid longer text.
            index = outlines_core.Index(f"(?:{regex})$", vocabulary)
        except Exception as exc:
            outbox.send(("error", str(exc)))
            continue
        outbox.send(("ok", (index, char_fsm_tables(regex))))


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
