"""Helpers the kernel tests and the calibrator share: where kernels run, and error measures.

Kernels run in the Triton interpreter on CPU tensors when ``TRITON_INTERPRET=1`` and on CUDA
otherwise. Nothing here is needed to use the kernels.
"""

from __future__ import annotations

import os

import torch


def interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device() -> str:
    """The device kernels run on: cpu in the interpreter, cuda otherwise."""
    return "cpu" if interpreter() else "cuda"


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over all elements, in fp64 (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den else num
