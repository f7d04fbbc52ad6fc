"""``radixkv serve``: an OpenAI-compatible server on the prefix-cached Engine."""
