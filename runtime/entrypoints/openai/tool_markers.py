"""The text that wraps a tool call in model output (Hermes/Qwen style), shared by the server and the DSL."""

OPEN, CLOSE = "<tool_call>", "</tool_call>"
