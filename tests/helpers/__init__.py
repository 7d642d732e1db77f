"""What the tests share, in one package (never imported from `conftest.py`): tiny models
and job specs, token windows and residual-like states, the brute-force oracles the
method's equations are checked against, a local Ray, local servers and processes.

Importing it sets how Ray runs in the test process, once, before any test imports Ray
(`RAY_TEST_ENV`): a Ray client fixes its authentication mode at its first cluster (and
a new local cluster with the mode unset turns token auth on for the whole process),
while each GCS it starts later reads the environment then. A process that set the mode
per cluster ended with a driver in one mode and a GCS in the other: every `ray.init`
after the two-node test failed in that pytest worker (19 errors in one run). One mode
for the whole session, inherited by every process a test starts, cannot disagree.

It sets how torch's OpenMP threads wait, too (`THREADS_TEST_ENV`), before any test
imports torch (conftest imports this package first; OpenMP reads it when torch loads).
"""

import os

RAY_TEST_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
"""Token auth off (Ray 2.60 turns it on when ~/.ray/auth_token exists, and writes one for
a new local Ray: the tests neither depend on nor touch the home directory), usage stats
off (no network here)."""
os.environ.update(RAY_TEST_ENV)

THREADS_TEST_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""An OpenMP thread that finishes its share of an operation sleeps until the next one
instead of spinning. The suite runs three test processes on two cores, beside their Ray
workers, so a process's second thread is often off its core: each operation then waits
for it while the first spins, on CPU that others needed. Measured on a busy machine:
tests/lorp/models/test_streaming.py took 68 CPU-seconds spinning, 16 passive; the
speed pass's timing of a tiny model 9.5 against 1.9. Nothing computed changes, only how
idle threads wait; every process a test starts (Ray's workers, `lorp run`, vLLM's
engine) inherits it. `setdefault`: a developer's own choice stays."""
for _key, _value in THREADS_TEST_ENV.items():
    os.environ.setdefault(_key, _value)
