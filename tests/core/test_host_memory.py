"""HeapTrimmer: small outputs kept between large transient batches fragment glibc's heap (the RSS grows by
the batches' size every iteration); trimming when the RSS has grown keeps it flat."""

import subprocess
import sys

import pytest

from trainer.core.host_memory import HeapTrimmer

PROGRAM = """
import sys, torch
from trainer.core.host_memory import HeapTrimmer, rss_mb
trim = HeapTrimmer(grow_mb=64) if sys.argv[1] == "trim" else (lambda: None)
kept, start = [], rss_mb()
for _ in range(300):
    big = [torch.ones(640_000) for _ in range(4)]  # 2.5 MB each: from the heap once glibc's threshold has risen
    kept.append(big[0][:5000].clone())  # a small per-batch output that stays, as an evaluation keeps its results
    del big
    trim()
print(round(rss_mb() - start))
"""


@pytest.mark.skipif(not HeapTrimmer().enabled, reason="needs glibc and /proc")
def test_trimmer_stops_heap_growth():
    growth = {mode: int(subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                                       check=True).stdout.strip().splitlines()[-1]) for mode in ("none", "trim")}
    assert growth["none"] > 300, growth  # the fragmentation is real (about 3 MB a batch here)
    assert growth["trim"] < 100, growth
