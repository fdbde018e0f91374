__version__ = "0.1.0"
#: 2: tensors may stream ahead of their step as TensorPiece messages.
PROTOCOL_VERSION = 2
#: Versions this server accepts (1: tensors only inline in StepRecords).
SUPPORTED_PROTOCOL_VERSIONS = (1, 2)
