"""The reference GPU worker: a torch model of the V4.1 structure behind the kvstore.v1.Worker service."""
