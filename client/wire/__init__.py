"""What both sides agree on: the phases of a step, the tensor codec, the statistics, the sketch.

The training side encodes with these modules and the server decodes with the same ones, so a
change here is a change of the wire contract (proto/ holds the messages; this package the
meaning of their bytes).  Nothing here imports a framework, gRPC or the runtime.
"""
