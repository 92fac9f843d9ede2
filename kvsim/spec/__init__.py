"""Validated, frozen inputs: scenario and schema, models, KV formats, hardware, workloads."""
