"""The reference worker: a torch model of the V4.1 structure behind the kvstore.v1.Worker service.

It runs on the CPU by default (`kvstore worker --device cuda` for a GPU); docs/WORKER.md.
"""
