"""Applications built on the library (imported only by the ``radixkv`` command line and tests).

- :mod:`radixkv.apps.cli`: the ``radixkv`` command line; one module per subcommand:
  :mod:`radixkv.apps.demo_cmd` and :mod:`radixkv.apps.replay_cmd`.
- :mod:`radixkv.apps.demo`: an agent session on the built-in model, with and without the cache.
- :mod:`radixkv.apps.trace`: request traces (Mooncake and radixkv JSONL, plain or gzipped).
- :mod:`radixkv.apps.replay`: a simulated server replaying a trace through a cache and scheduler.
- :mod:`radixkv.apps.caches`: a cache chosen by name (``--cache radix|block``).
"""
