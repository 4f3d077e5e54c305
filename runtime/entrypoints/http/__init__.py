"""The HTTP server: the app, its guard (keys, origins, tenants), body parsing, errors and metrics."""
