"""Triton kernels for kvsim's KV-cache formats, each beside its torch reference.

See kernels/README.md for the modules, launcher signatures and formats. Importing this package
imports nothing heavy; import the modules (``kernels.paged_decode`` etc.) for torch and Triton.
"""
