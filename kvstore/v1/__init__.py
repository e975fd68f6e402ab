"""Generated wire code for kvstore.v1: do not edit (scripts/gen_proto.py)."""
