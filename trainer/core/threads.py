"""How OpenMP threads wait, chosen before torch (and its OpenMP runtime) is loaded.

torch's CPU wheels use GNU OpenMP, whose threads spin between parallel regions unless told otherwise. A spinning
thread is runnable, so the kernel shares its core with another process's busy thread in whole timeslices; every
small operator's region then waits a timeslice for its thread on the busy core, and the spinning threads take CPU the
other process (or this process's own xTB workers) would use. Sampling and training run many small operators, so
beside another job they slow far beyond the share of CPU they lose (BENCHMARKS.md, "Guided sampling under load").
A passive wait (a thread sleeps as soon as its region ends) costs a wake-up per region when the
machine is idle and avoids the collapse when it is not. The runtime reads the policy once, when it is loaded: this
must run before `import torch`.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

WAIT_POLICY = "PASSIVE"
"""OMP_WAIT_POLICY set where the user set neither it nor GOMP_SPINCOUNT."""


def set_openmp_wait_policy(environ: MutableMapping[str, str] | None = None) -> str | None:
    """OMP_WAIT_POLICY=PASSIVE in `environ` (default: this process's) unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    set there already (the user's choice is kept); returns the value set, or None when nothing was changed."""
    env = os.environ if environ is None else environ
    if env.get("OMP_WAIT_POLICY") or env.get("GOMP_SPINCOUNT"):
        return None
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return WAIT_POLICY
