"""Serving front end (OpenAI-compatible HTTP server, benchmark client): not started.
`dspine_jax.api.Pipeline` is the interface it will wrap."""
