"""The front doors into the engine: the HTTP server, the OpenAI routes, the dashboard, the router and the CLIs."""
