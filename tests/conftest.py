"""Session-wide test setup.

Triton picks interpreter or GPU when a kernel module is imported, so the choice is made here,
before any test module imports ``kernels``: the interpreter unless the caller set
TRITON_INTERPRET (``TRITON_INTERPRET=0`` on a GPU machine runs the kernel tests on the device).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
