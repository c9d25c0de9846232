"""`protein_sedd`: Score Entropy Discrete Diffusion on protein sequences (FASTA ingest, DDiT, SEDD, sampling)."""

from trainer.families.protein_sedd.task import ProteinSEDDConfig, ProteinSEDDTask

__all__ = ["ProteinSEDDConfig", "ProteinSEDDTask"]
