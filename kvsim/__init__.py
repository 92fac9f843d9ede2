"""kvsim: a discrete-event simulator of LLM-inference clusters centred on the KV cache.

The Python API (README.md, "From Python"): `load_scenario` reads and validates a scenario file
(with ``--set``-style overrides), `run_scenario` simulates it into a `RunResult` whose ``record``
is the `RunSummary` that ``summary.json`` holds; `write_run` writes a run directory and
`read_summary` reads one back. Errors in the input raise `KvsimError`. The names load on first
use, so ``import kvsim`` stays cheap (no numpy, SimPy or YAML until a name is asked for).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsim.errors import KvsimError
    from kvsim.results.record import RunSummary, read_summary
    from kvsim.run import RunResult, run_scenario, write_run
    from kvsim.spec.scenario import Scenario, load_scenario

__version__ = "0.1.0"

_API = {
    "load_scenario": "kvsim.spec.scenario",
    "Scenario": "kvsim.spec.scenario",
    "run_scenario": "kvsim.run",
    "RunResult": "kvsim.run",
    "write_run": "kvsim.run",
    "RunSummary": "kvsim.results.record",
    "read_summary": "kvsim.results.record",
    "KvsimError": "kvsim.errors",
}

__all__ = [
    "KvsimError",
    "RunResult",
    "RunSummary",
    "Scenario",
    "__version__",
    "load_scenario",
    "read_summary",
    "run_scenario",
    "write_run",
]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsim' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
