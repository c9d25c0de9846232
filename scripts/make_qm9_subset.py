"""Make the bundled QM9 subset `trainer/families/molecules_edm/samples/qm9_3k.extxyz.gz`.

A deterministic random subset: `numpy.random.default_rng(SEED).choice(frames, SIZE, replace=False)`,
kept in source-file order; every chosen frame is copied byte for byte (coordinates and the per-frame
info line unchanged) and gzip-compressed with a zero timestamp, so the output is reproducible.

    python scripts/make_qm9_subset.py SOURCE [OUTPUT]
"""

from __future__ import annotations

import gzip
import hashlib
import sys
from pathlib import Path

import numpy as np

from trainer.families.molecules_edm.readers import bundled_qm9_path, iter_xyz_frames

SEED = 20220712
"""Fixed seed of the subset (EDM's ICML 2022 date)."""
SIZE = 3000


def make_subset(source: Path, output: Path, size: int = SIZE, seed: int = SEED) -> int:
    """Write `size` randomly chosen frames of `source` to `output`; returns the number of source frames."""
    frames = [text for _, text in iter_xyz_frames(source)]
    chosen = np.sort(np.random.default_rng(seed).choice(len(frames), size=size, replace=False))
    data = "".join(frames[k] for k in chosen).encode("utf-8")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(data)
    tmp.replace(output)
    print(f"{output}: {size} of {len(frames)} frames, {output.stat().st_size} bytes, "
          f"sha256 of the text {hashlib.sha256(data).hexdigest()}")
    return len(frames)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/make_qm9_subset.py SOURCE [OUTPUT]  (SOURCE: the 10,000-molecule extxyz.gz)")
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else bundled_qm9_path()
    make_subset(src, out)
