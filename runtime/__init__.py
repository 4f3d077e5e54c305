"""The inference engine: model, scheduler, sampling, constraints and the HTTP server."""
