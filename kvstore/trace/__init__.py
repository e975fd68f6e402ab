"""Real workloads: read public request traces, simulate the store's rules on them, replay them.

A trace names each prompt's blocks by integer ids; `tokens` turns an id into a
deterministic run of token ids, so kvstore's own prefix hashes (`kvstore.prefix`)
apply to trace prompts unchanged and two prompts share stored blocks exactly where
their id lists share a leading run (docs/CAPACITY.md).

Modules:
    requests   the trace's values: `TraceRequest`, `Trace`.
    weka       the weka/kv-cache-tester per-session JSON (nested subagent sessions).
    mooncake   Mooncake's JSONL (one request a line, 512-token blocks).
    load       `load_trace(path)`: pick the reader by the path, order requests by arrival.
    tokens     block id -> token ids (`BlockTokens`), and a request's prompt.
    sim_index  an in-memory record index with the LMDB tier's write-transaction interface.
    simulate   `Simulation`: the store's retention, eviction, capacity and the planner on virtual time.
    sim_report what a simulation measured, as text, charts and JSON.
    replay     `kvstore trace replay`: drive a running server through the real client.
    command    the `kvstore trace` command.

Like `kvstore/bench/`, the simulation and replay modules are a composition root: they
run the NVMe tier's rules (`tiers.retention`, `tiers.eviction`, `tiers.puts`) and the
resume planner (`replay.planner`) offline, and nothing below imports them.
"""
