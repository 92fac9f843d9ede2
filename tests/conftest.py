"""Session-wide test setup.

Triton picks interpreter or GPU when a kernel module is imported, so the choice is made here,
before any test module imports ``kernels``: the interpreter unless the caller set
TRITON_INTERPRET (``TRITON_INTERPRET=0`` on a GPU machine runs the kernel tests on the device).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run (`derandomize`), so CI on a clean clone passes
# or fails on the code, not on the draw. Search for new failures with random draws (run it a few times):
#   HYPOTHESIS_PROFILE=explore python -m pytest tests/test_engine_properties.py
# and pin what it finds as an ordinary test. Many more draws of one property than its decorator's
# max_examples: tests/explore.py (e.g. 1,000 of the faults' and the autoscaler's: 49 s and 93 s).
# No example has a deadline and no health check is on time (hypothesis's defaults are 200 ms and
# "too slow"): no test relies on wall time, and a loaded machine must not fail one.
from hypothesis import HealthCheck, settings

untimed = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, database=None, **untimed)
settings.register_profile("explore", derandomize=False, **untimed)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
