"""Operator commands of the `kvstore` CLI, one module per command, imported only when that command runs."""
