"""Engine adapters: kvstore inside vLLM (KV connector) and SGLang (HiCache storage backend)."""
