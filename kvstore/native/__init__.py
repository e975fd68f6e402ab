"""Native helpers the worker side and the server share: the block record's layout
(`records`), the verify-and-copy loop (`blockcopy`), the SWA paths' checksums (`swa_digest`) and
the request ring's shared half (`ring`), each with its C module where one was built at install.

They sit below both `kvstore.client` and `tiers`: a worker that reads a same-host store's file,
fills a ring or checks an SWA snapshot needs them, and nothing of the store that serves.
"""
