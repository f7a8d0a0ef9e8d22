"""``medusa serve``: an OpenAI-compatible HTTP server decoding with the trained drafters, with continuous batching.

- :mod:`medusa.serve.protocol`: request bodies validated, OpenAI-style errors;
- :mod:`medusa.serve.text`: incremental detokenisation and stop strings;
- :mod:`medusa.serve.metrics`: ``GET /metrics`` in Prometheus' text format;
- :mod:`medusa.serve.scheduler`: the thread that owns the model (continuous batching, speculative or plain steps);
- :mod:`medusa.serve.app`: the routes (Starlette) and :func:`medusa.serve.run.serve` (uvicorn, SIGTERM drain).
"""
