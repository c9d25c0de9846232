"""The OpenMP wait policy (trainer/core/threads.py): passive unless the user chose, set by the command line before
torch's OpenMP runtime is loaded (it reads the policy once)."""

import os
import subprocess
import sys

from trainer.core.threads import WAIT_POLICY, set_openmp_wait_policy


def test_passive_wait_unless_the_user_chose():
    env: dict[str, str] = {}
    assert set_openmp_wait_policy(env) == WAIT_POLICY == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(chosen)
        assert set_openmp_wait_policy(env) is None and env == chosen


def test_the_command_line_sets_it_before_torch_is_loaded():
    probe = ("import os, sys\n"
             "import trainer.cli as cli\n"
             "def parse_args(argv):\n"
             "    print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
             "    raise SystemExit(0)\n"
             "cli.parse_args = parse_args\n"
             "cli.main(['train', 'c.yaml'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PASSIVE", "False"]
