"""OpenAI's chat and completions routes, their protocol models, tool calls and reasoning output."""
