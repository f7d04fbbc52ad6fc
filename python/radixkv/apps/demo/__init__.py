"""``radixkv demo``: an agent session with and without the prefix cache."""
