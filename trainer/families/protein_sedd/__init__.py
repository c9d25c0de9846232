"""`protein_sedd`: Score Entropy Discrete Diffusion on protein sequences (FASTA ingest, DDiT, SEDD, sampling).

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `ProteinSEDDTask`, imported
when a run needs it (importing this package imports no torch)."""

from trainer.families.protein_sedd.spec import ProteinSampleConfig, ProteinSEDDConfig

__all__ = ["ProteinSEDDConfig", "ProteinSampleConfig"]
