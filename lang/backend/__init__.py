"""Backends that run prompt programs: an HTTP endpoint or an in-process engine."""
