"""Parity: the code the three services share.

This package holds what every service needs and nothing service-specific: typed config, the gRPC
server bootstrap (health, reflection, auth), the sampling transform the trainer and the reference
engine replay, version bookkeeping, test/launcher process helpers, model preparation, and the
generated `parity.v1` protobuf stubs. Heavy imports (torch, vllm, transformers) stay inside the
functions that need them so that `parity --help` is instant.
"""

__version__ = "0.1.0"
