"""What the applications share: command-line helpers, traces, caches by name, metrics."""
