"""The model's own bytes: DeepSeek-V4.1-Flash cache rows, blocks and SWA snapshots.

Each module is imported on its own (`from kvstore.codec import fp4`); this
package imports nothing itself, so the storage server, which never needs torch,
can import a byte-only module of it without pulling the rest in.
"""
