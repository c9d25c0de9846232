"""Run one shard job of a parallel build in a spawned worker, as the build's pool runs it, and report the modules
the worker loaded: the families' tests check that a worker imports neither torch nor `datasets`."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT

HEAVY = ("torch", "datasets")

_PROBE = (
    "import sys\n"
    f"HEAVY = {HEAVY!r}\n"
    "def run(fn, args, out):\n"
    "    loaded = [m for m in HEAVY if m in sys.modules]\n"
    "    assert not loaded, ('on import', loaded)\n"
    "    fn(*args, out)\n"
    "    return [m for m in HEAVY if m in sys.modules]\n")


def run_job_in_spawned_worker(fn: Any, args: tuple, out: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`fn(*args, out)` in a spawned pool worker of a fresh interpreter; the process fails (its stderr says why)
    when the worker had loaded a module of HEAVY on unpickling the job or after running it."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "worker_probe.py").write_text(_PROBE)
    job = probe_dir / f"{out.name}.job.pkl"
    job.write_bytes(pickle.dumps((fn, args)))
    code = ("import multiprocessing, pickle, sys\n"
            f"sys.path.insert(0, {str(probe_dir)!r})\n"
            "import worker_probe\n"
            f"fn, args = pickle.loads(open({str(job)!r}, 'rb').read())\n"
            "with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
            f"    loaded = pool.apply(worker_probe.run, (fn, args, {str(out)!r}))\n"
            "assert not loaded, ('after the job', loaded)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
