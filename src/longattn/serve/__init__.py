"""`longattn serve`: an OpenAI-compatible HTTP server over a continuously batched engine
and a paged KV pool (see docs/serve.md)."""
