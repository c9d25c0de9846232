"""`arrow_cache.build_shards`: temp names per build, cleanup of this build's files only, bounded generators."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from trainer.atomic_io import temp_path
from trainer.data import arrow_cache


def _write(text: str, tmp: str) -> int:
    Path(tmp).write_text(text)
    return len(text)


def _fail(tmp: str) -> None:
    Path(tmp).write_text("half")
    raise RuntimeError("worker failed")


def test_failed_build_removes_only_its_own_temp_files(tmp_path):
    """Another builder writing the same shard at the same time (another node, or another process here) keeps
    its temp file when this build fails."""
    final = tmp_path / "shard-00000.arrow"
    others = [final.with_name(f".{final.name}.{socket.gethostname()}-99999-1.tmp"),  # as temp_path names them
              temp_path(final)]  # this very process, e.g. another thread's build
    for other in others:
        other.write_text("another builder's half-written shard")
    with pytest.raises(RuntimeError, match="worker failed"):
        arrow_cache.build_shards([(_fail, (), final)])
    assert all(other.exists() for other in others)
    assert sorted(tmp_path.iterdir()) == sorted(others)  # this build's own temp file is gone, no shard


def test_jobs_from_a_generator_in_order_with_progress(tmp_path):
    done = []
    jobs = ((_write, (f"row {k}",), tmp_path / f"s{k}") for k in range(5))
    assert arrow_cache.build_shards(jobs, on_done=lambda i, r: done.append((i, r))) == [5] * 5
    assert done == [(k, 5) for k in range(5)]
    assert [p.read_text() for p in sorted(tmp_path.iterdir())] == [f"row {k}" for k in range(5)]


def test_generator_error_comes_after_the_jobs_before_it(tmp_path):
    def jobs():
        yield _write, ("a",), tmp_path / "a"
        raise ValueError("input damaged")

    with pytest.raises(ValueError, match="input damaged"):
        arrow_cache.build_shards(jobs())
    assert (tmp_path / "a").read_text() == "a" and not list(tmp_path.glob(".*.tmp"))


def _slow_fail(tmp: str) -> None:
    import time
    time.sleep(1.0)
    raise RuntimeError("worker failed")


def test_a_failed_parallel_build_publishes_only_the_jobs_before_the_failure(tmp_path):
    """Jobs after the failed one that finished in another worker are not renamed into place: only temp files
    of them existed, and those are removed (a worker renaming its own shard published one its caller, stopping
    the pool at the failure, might never hear of)."""
    jobs = [(_write, ("a",), tmp_path / "a"), (_slow_fail, (), tmp_path / "b"), (_write, ("c",), tmp_path / "c")]
    renamed: list[str] = []
    with pytest.raises(RuntimeError, match="worker failed"):
        arrow_cache.build_shards(jobs, num_proc=3, renamed=renamed)
    assert renamed == [str(tmp_path / "a")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
