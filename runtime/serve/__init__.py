"""Serving: an OpenAI-compatible HTTP front-end, the engine process behind it over ZeroMQ, and
Prometheus metrics of the expert cache."""
