"""The engine: its parts assembled from ServerArgs, the loop thread that runs them, and the public ``Engine``."""

from radixlm.runtime.engine.api import Engine
from radixlm.runtime.engine.assembly import EngineParts, build_parts, make_grammar_compiler
from radixlm.runtime.engine.loop import EngineError, EngineLoop

__all__ = ["Engine", "EngineError", "EngineLoop", "EngineParts", "build_parts", "make_grammar_compiler"]
