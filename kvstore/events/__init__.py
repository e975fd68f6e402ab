"""KV cache events in vLLM's format (docs/EVENTS.md): the wire structs and the ZMQ publisher.

The store's tier logs each commit's events in the commit (`tiers/events.py`); this package
holds what does not touch the store: the msgpack structs (`wire`) and the sockets (`publisher`).
Both need the `events` extra (pyzmq, msgspec); nothing imports them while events are off.
"""
