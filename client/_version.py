__version__ = "0.1.0"
#: 3: full tensors travel only as TensorPiece messages ahead of their step, and every step sends m2.
PROTOCOL_VERSION = 3
#: Versions this server accepts (1 sent tensors inline in StepRecords, 2 allowed that beside pieces and
#: steps without m2; both are refused at Hello).
SUPPORTED_PROTOCOL_VERSIONS = (3,)
