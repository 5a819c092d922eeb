"""FAKE: a native crash in interpreter teardown, made deterministic.

A process started with this directory first on PYTHONPATH aborts (SIGABRT) if its interpreter
runs its exit handlers, as a gloo worker or gRPC thread that needs the GIL of a finalising
interpreter does now and then (parity.process_exit). A service that ends without teardown never
runs them and keeps its exit code.
"""

import atexit
import os

atexit.register(os.abort)
