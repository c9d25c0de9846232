"""Synthetic molecule shards at GEOM-Drugs' row shape, without a build: what a rank's start-up reads.

`write_molecule_shards` writes `shards` Arrow shards of the molecule cache's core columns: small molecules (3-8
atoms of H, C, N, O), a ~60-character SMILES per 30 rows (a GEOM-Drugs molecule's 30 conformers share one), every
7th row's SMILES null (an invalid molecule). Used by `scale_molecules.py --per-row` and the rank-memory tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from trainer.data.arrow_shards import arrow_schema, shard_writer, write_table
from trainer.families.molecules_edm.pieces import core_features


def write_molecule_shards(directory: Path, rows: int, shards: int, one_batch: bool = False) -> list[Path]:
    """Write the shards as `directory/s000.arrow`, ... and return their paths. `one_batch`: one record batch a
    shard (as GEOM builds write them); else the writer's default batches (as the xyz/SDF builds)."""
    rng = np.random.default_rng(0)
    schema = arrow_schema(core_features(True))
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    paths = []
    for s, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        n = b - a
        sizes = rng.integers(3, 9, size=n).astype(np.int32)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(sizes, out=offsets[1:])
        numbers = rng.choice(np.array([1, 6, 7, 8], np.int8), size=int(offsets[-1]))
        positions = rng.normal(size=int(offsets[-1]) * 3).astype(np.float32)
        smiles = [None if r % 7 == 3 else f"CC(=O)NC1=CC=C(O)C=C1{'C' * 30}{r // 30:09d}" for r in range(a, b)]
        table = pa.Table.from_arrays([
            pa.array([f"m{r}" for r in range(a, b)], pa.string()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(numbers)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.FixedSizeListArray.from_arrays(pa.array(positions), 3)),
            pa.array(sizes), pa.array(smiles, pa.string())], schema=schema)
        paths.append(Path(directory) / f"s{s:03d}.arrow")
        with shard_writer(schema, str(paths[-1])) as writer:
            if one_batch:
                write_table(writer, table, batch_rows=max(n, 1))
            else:
                write_table(writer, table)
    return paths
