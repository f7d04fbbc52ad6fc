"""Applications built on the library (imported only by the ``radixkv`` command line and tests).

One package per application, each with the subcommand's module ``cmd``, and one for what they
share:

- :mod:`radixkv.apps.cli`: the ``radixkv`` command line; it imports only the subcommand run.
- :mod:`radixkv.apps.serve`: ``radixkv serve``, the OpenAI-compatible server (``app``: the HTTP
  routes; ``engine_loop``: the engine thread; ``completion``: a request's way through it;
  ``openai``: OpenAI's shapes; ``responses``, ``messages``: the agent APIs; ``request_fields``,
  ``structured``, ``tool_calls``, ``content_parts``: what a request may hold and how it is read).
- :mod:`radixkv.apps.replay`: ``radixkv replay``, a simulated server replaying a trace through a
  cache and scheduler (``simulate``), offline bounds (``offline``, ``belady``, ``block_keys``,
  ``prefill_queue``) and the synthetic agent workload (``agent_workload``).
- :mod:`radixkv.apps.demo`: ``radixkv demo``, an agent session with and without the cache, on
  the built-in model (``scenario``) or a real one (``real``).
- :mod:`radixkv.apps.doctor`: ``radixkv doctor``, why a log of chat requests misses the cache.
- :mod:`radixkv.apps.common`: command-line helpers (``args``), request traces (``trace``:
  Mooncake and radixkv JSONL, plain or gzipped), a cache chosen by name (``caches``) and the
  metrics endpoint of demo and replay (``metrics_server``).
"""
