"""Kernel tests: on a CPU they run in the Triton interpreter on tiny shapes; on a GPU (run with
``TRITON_INTERPRET=0``) the same tests run on CUDA, plus realistic shapes.

``TRITON_INTERPRET`` must be set before triton is imported, hence the first lines. The directory is
skipped, with the reason, where torch or triton cannot be imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need torch (pip install torch)")
pytest.importorskip("triton", reason="kernel tests need triton (pip install triton)")

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available()

if not INTERPRETER and not ON_GPU:
    pytest.skip(
        "TRITON_INTERPRET is not 1 and there is no CUDA device to run Triton on",
        allow_module_level=True,
    )


@pytest.fixture
def device() -> str:
    """Where the kernels run: cpu in the interpreter, cuda otherwise."""
    from kernels.testing import kernel_device

    return kernel_device()
