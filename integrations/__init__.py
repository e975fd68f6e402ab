"""Engine adapters: kvstore plugged into inference engines (docs/ENGINES.md).

- `integrations.vllm_connector.KVStoreConnector`: a vLLM v1 KV connector
  (`kv_connector_module_path="integrations.vllm_connector"`).
- `integrations.sglang_backend`: an SGLang HiCache storage backend.
- `integrations.common`: what both share (settings, clients, the usable-token rule,
  the mapping of store blocks onto an engine's pages).

A top-level package, not under `kvstore/`: the adapters use `replay.planner`,
which the core may not import (tests/kvstore/test_wire.py). Nothing here is
imported by kvstore itself; the engines are imported only by their own modules.
"""
