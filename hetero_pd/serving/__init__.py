"""Serving: worker processes, router, OpenAI-compatible REST API."""
