"""OpenAI's Responses API: /v1/responses, its stored responses and its event stream."""
