"""`trainer rendezvous`: an elastic run's c10d rendezvous store in a process of its own.

Under torchrun the agent whose host matches --rdzv-endpoint hosts the store, and when that agent dies the store
dies with it and every other agent fails (pytorch#67742). Started first, on a host whose loss ends the job
anyway (a SLURM batch step's host, a login or head node), this process holds the port; the agents' c10d backend
then finds the address taken and connects as a client, so any node can be lost.

It ignores SIGHUP: started from a login shell or an ssh session that then closes, it must go on serving the run.
SIGTERM or Ctrl-C end it.
"""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta


def serve(host: str, port: int) -> int:
    """Host the store on host:port (0: a free port) until SIGTERM or Ctrl-C; the address is printed first."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # before the store exists: a hang-up while torch imports too
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                     multi_tenant=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"trainer: rendezvous store on {host}:{store.port}; agents reach it with --rdzv HOST:{store.port}",
          flush=True, file=sys.stderr)
    stop.wait()
    return 0
