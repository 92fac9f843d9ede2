"""What-if sweeps: many runs of one scenario under override grids (``kvsim sweep``).

`define` (factors and points), `runner` (validation, resume, results), `local` (the process-pool
executor), `table` (manifest, results.csv, Pareto front). The HTML page is `kvsim.report.sweep`.
"""
