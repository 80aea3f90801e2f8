"""Serving front end (OpenAI-compatible HTTP server, benchmark client)."""
