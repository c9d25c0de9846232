"""Regenerate the bundled mlearn Mo subsets of trainer/families/crystals/samples/ from the public files.

Fetches mlearn Mo training and test (materialsvirtuallab/mlearn, BSD-3-Clause) with their checksums
(`trainer data fetch mlearn_mo_training mlearn_mo_test`; see trainer/data/fetch.py), keeps every 5th
record in file order (records unchanged: `json.dumps` of the parsed file gives back its exact bytes) and
writes them gzip-compressed (level 9, no name or time stamp, so the output is reproducible):

    mlearn_Mo_training_39.json.gz   records 0, 5, ..., 190 of data/Mo/training.json (39 of 194)
    mlearn_Mo_test_5.json.gz        records 0, 5, ..., 20 of data/Mo/test.json (5 of 23)

and checks that the bundled mlearn_Si_{training,test}.json.gz decompress to the fetched Si files.

    python scripts/make_crystal_samples.py [--out trainer/families/crystals/samples]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

from trainer.data.fetch import fetch

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "trainer" / "families" / "crystals" / "samples"
STEP = 5


def mo_subset(split: str) -> tuple[str, bytes]:
    records = json.loads(fetch(f"mlearn_mo_{split}").read_text())
    subset = records[::STEP]
    return f"mlearn_Mo_{split}_{len(subset)}.json.gz", json.dumps(subset).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(SAMPLES))
    out = Path(parser.parse_args().out)
    for split in ("training", "test"):
        name, data = mo_subset(split)
        with open(out / name, "wb") as raw, gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw,
                                                          mtime=0) as f:
            f.write(data)
        print(f"{out / name}: {len(data):,} bytes of JSON, sha256 {hashlib.sha256(data).hexdigest()}")
    for split in ("training", "test"):
        bundled = gzip.decompress((SAMPLES / f"mlearn_Si_{split}.json.gz").read_bytes())
        if bundled != fetch(f"mlearn_si_{split}").read_bytes():
            print(f"bundled mlearn_Si_{split}.json.gz differs from the public file", file=sys.stderr)
            return 1
    print("bundled mlearn_Si_{training,test}.json.gz: identical to the public files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
