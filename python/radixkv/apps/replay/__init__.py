"""``radixkv replay``: a request trace through a cache and scheduler, per policy."""
