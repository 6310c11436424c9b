"""`quantkit serve`: the OpenAI-compatible HTTP server on the continuous-batching engine."""
