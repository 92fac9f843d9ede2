"""Run one property test's body over N fresh random draws (CI runs each a fixed, derandomized few):

    python tests/explore.py tests.test_faults test_random_faults_keep_every_request_and_the_invariants fault_cases 1000

MODULE TEST STRATEGY N: the test (a ``@given(case=...)`` property), the module-level strategy that
feeds it, and how many draws. A failure prints hypothesis's shrunk example; pin it as a test.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: no GPU needed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, settings


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not argv[3].isdigit():
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    mod, name, strategy, n = argv[0], argv[1], argv[2], int(argv[3])
    m = importlib.import_module(mod)
    inner = getattr(m, name).hypothesis.inner_test
    t0 = time.perf_counter()
    run = settings(
        max_examples=n,
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(given(case=getattr(m, strategy)())(inner))
    run()
    print(f"{name}: {n:,} random draws passed in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
