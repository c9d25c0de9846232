"""HeapTrimmer: small outputs kept between the blocks of a large transient batch keep glibc's heap from
shrinking when the batch is freed; a trim returns those pages, and the trimmer trims only after growth."""

import subprocess
import sys

import pytest

from trainer.core.host_memory import HeapTrimmer

PROGRAM = """
import ctypes, sys
from trainer.core.host_memory import HeapTrimmer, rss_mb
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.restype, libc.memset.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
# A fixed mmap threshold: 1 MiB blocks come from the heap every time (glibc's dynamic threshold makes whether
# they do depend on the process's history, which made this test flaky).
assert libc.mallopt(-3, 16 << 20) == 1  # M_MMAP_THRESHOLD
trim = HeapTrimmer(grow_mb=64) if sys.argv[1] == "trim" else (lambda: None)
start, bigs, kept = rss_mb(), [], []
for _ in range(200):  # one large batch: its blocks interleaved with small outputs that stay
    bigs.append(libc.malloc(1 << 20))
    libc.memset(bigs[-1], 1, 1 << 20)
    kept.append(libc.malloc(4096))
for block in bigs:
    libc.free(block)
trim()
print(round(rss_mb() - start))
"""


@pytest.mark.skipif(not HeapTrimmer().enabled, reason="needs glibc and /proc")
def test_trimmer_returns_freed_heap_pages():
    growth = {mode: int(subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                                       check=True).stdout.strip().splitlines()[-1]) for mode in ("none", "trim")}
    assert growth["none"] > 150, growth  # the freed 200 MiB stay resident: the small blocks pin the heap's top
    assert growth["trim"] < 30, growth


def test_trimmer_trims_only_after_growth(monkeypatch):
    from trainer.core import host_memory

    rss, calls = [100.0], []
    monkeypatch.setattr(host_memory, "rss_mb", lambda: rss[0])
    monkeypatch.setattr(host_memory, "_TRIM", lambda pad: calls.append(pad) or rss.__setitem__(0, 110.0))
    trimmer = host_memory.HeapTrimmer(grow_mb=64)
    rss[0] = 150.0
    trimmer()
    assert calls == []
    rss[0] = 200.0
    trimmer()
    assert calls == [0] and trimmer.trims == 1 and trimmer.base == 110.0


def test_eval_outputs_keep_every_value_in_order_in_a_few_tensors():
    import torch

    from trainer.core.host_memory import EvalOutputs

    outputs = EvalOutputs(join_every=3)
    batches = [torch.arange(start, start + size, dtype=torch.float64) for start, size in
               zip(range(0, 70, 10), (4, 1, 7, 2, 9, 3, 5))]
    for b in batches:
        outputs.add({"pred": b, "row": b.long()})
    assert len(outputs.joined["pred"]) == 2 and len(outputs.pending["pred"]) == 1  # 7 batches: 3 + 3 joined, 1 left
    columns = outputs.columns()
    assert torch.equal(columns["pred"], torch.cat(batches).float())
    assert columns["row"].dtype == torch.float64 and torch.equal(columns["row"], columns["pred"].double())
    big = EvalOutputs()
    big.add({"row": torch.tensor([2**24 + 1, 2**40 + 3])})  # past float32's exact integers
    assert big.columns()["row"].long().tolist() == [2**24 + 1, 2**40 + 3]
    assert EvalOutputs().columns() == {}
