"""``radixkv doctor``: why a log of chat requests misses the cache."""
