"""Generated wire contract (twinstep.v1); regenerate with scripts/gen_proto.py."""
