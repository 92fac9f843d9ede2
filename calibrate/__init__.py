"""Calibrator: times GEMMs, attention kernels and copies on a device and writes a measured profile.

Run ``python -m calibrate --device cuda --out PROFILE.json`` (or ``kvsim calibrate ...``). The
profile (schema ``kvsim-profile`` v1, read by `kvsim.costs.profile`) is data with provenance: device,
driver, torch/triton versions, date, host, model shapes, TP and the grid of timed points.
"""
