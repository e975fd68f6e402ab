"""The gRPC front of kvstore: servicers, request validation, the server process."""
