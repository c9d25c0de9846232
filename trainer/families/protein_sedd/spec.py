"""`protein_sedd` as the registry knows it without importing torch: the task options, the sampling options
(`trainer sample`), presets, unit and metrics. The Task class (`task.py`) is imported only when a run needs it."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.registry import register_spec
from trainer.task import SampleConfig, TaskConfig, TaskSpec


@dataclass
class ProteinSEDDConfig(TaskConfig):
    name: str = "protein_sedd"
    """Registered task name."""
    data_path: str = ""
    """FASTA or FASTA.gz file (UniProtKB or UniRef50 headers); empty: the bundled 3,000-sequence sample."""
    cache_dir: str = ""
    """Arrow cache of the parsed and tokenized data (empty: the `datasets` default cache)."""
    val_fraction: float = 0.05
    """Share of sequences in validation, chosen by hashing the sequence id (stable across runs)."""
    min_length: int = 0
    """Drop (and count) sequences shorter than this (0: no limit)."""
    nonstandard: str = "keep"
    """Non-standard residues B Z J U O X: keep (J becomes X), map (to X) or drop (the record); counted."""
    max_length: int = 128
    """Residues per training crop (random window) and eval crop (first residues)."""
    start_crop_share: float = 0.0
    """Share of the training crops of longer sequences that are their first `max_length` residues (the window eval
    scores: it starts with the initiator Met); the others are uniform random windows."""
    model_preset: str = "tiny"
    """DDiT size: tiny, small (paper's 12 x 768) or medium (24 x 1024)."""
    dropout: float = 0.1
    """Dropout inside the DDiT blocks."""
    graph: str = "absorb"
    """Forward process: absorb (masking) or uniform."""
    noise: str = "loglinear"
    """Noise schedule: loglinear or geometric."""
    sampling_eps: float = 1e-3
    """Smallest diffusion time drawn for the loss."""
    loss_reduction: str = "token"
    """Training loss scale: `token`, the score entropy per token (over all tokens of the step); `sequence_sum`,
    the mean over the step's sequences of each one's sum (SEDD's, the per-token loss x the length for full crops:
    the same train.grad_clip_norm then clips other gradients). Micro-batches are then weighted by sequences, and
    the logged tokens_per_s counts sequences. Evaluation is per token either way."""
    eval_seed: int = 1234
    """Seed of the per-sample eval generators (diffusion times and corruption)."""
    eval_draws: int = 8
    """Diffusion times per eval sequence, evenly spaced from one random offset (stratified); the eval NELBO is
    their mean (1: the single draw of the training loss, a noisy estimate)."""
    packing: bool = False
    """SEDD-style packing: training sequences (in a seeded order) joined by a separator state and cut into
    blocks of max_length, so no position is padding; eval stays one crop per sequence."""
    streaming: bool = False
    """Read the training split as a stream (bounded memory, for the full UniRef50 file); validation stays Arrow."""

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.start_crop_share <= 1.0:
            raise ValueError(f"task.start_crop_share must be in [0, 1], got {self.start_crop_share}")
        if self.loss_reduction not in ("token", "sequence_sum"):
            raise ValueError(f"task.loss_reduction must be 'token' or 'sequence_sum', got {self.loss_reduction!r}")
        if self.eval_draws < 1:
            raise ValueError(f"task.eval_draws must be >= 1, got {self.eval_draws}")
        if self.packing and self.streaming:
            raise ValueError("task.packing works on the cached (non-streaming) training split; drop one of the two")


MAX_SAMPLE_LENGTH = 4096
"""Longest sequence `trainer sample` draws (the DDiT attends over the whole sequence at every step)."""


@dataclass
class ProteinSampleConfig(SampleConfig):
    steps: int = 0
    """Sampler steps (0: the sequence length)."""
    sampler: str = "analytic"
    """`analytic` (Tweedie tau-leaping) or `euler`."""
    length: int = 0
    """Fixed sequence length (0: drawn from the training crops' length histogram, a run artifact)."""

    def validate(self) -> None:
        super().validate()
        if self.sampler not in ("analytic", "euler"):
            raise ValueError(f"sampler must be 'analytic' or 'euler', got {self.sampler!r}")
        if self.steps < 0 or not 0 <= self.length <= MAX_SAMPLE_LENGTH:
            raise ValueError(f"steps must be >= 0 and length in [0, {MAX_SAMPLE_LENGTH}], got {self.steps} and {self.length}")


PRESETS = {
    "tiny": {"task": {"model_preset": "tiny", "max_length": 64, "dropout": 0.0},
             "train": {"max_steps": 200, "per_device_batch_size": 16, "ema_decay": 0.99},
             "optim": {"lr": 1e-3, "warmup_steps": 20, "scheduler": "constant_with_warmup"}},
    "small": {"task": {"model_preset": "small", "max_length": 512},
              "train": {"per_device_batch_size": 32, "ema_decay": 0.9999},
              "optim": {"lr": 3e-4, "warmup_steps": 2500}},
    # SEDD's own recipe (its configs/config.yaml, small model): the loss as a batch mean of per-sequence sums,
    # which the norm clip of 1 acts on; warm-up and EMA counted as its optimization_manager and EMA count them.
    "paper": {"task": {"model_preset": "small", "max_length": 1024, "dropout": 0.1, "graph": "absorb",
                       "noise": "loglinear", "loss_reduction": "sequence_sum"},
              "train": {"max_steps": 1_300_001, "global_batch_size": 512, "per_device_batch_size": 32,
                        "ema_decay": 0.9999, "ema_warmup": "sedd", "grad_clip_norm": 1.0, "grad_clip_mode": "norm"},
              "optim": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                        "scheduler": "constant_with_warmup", "warmup_steps": 2500,
                        "warmup_counts_current_step": True}},
}
"""Named config layers (`task.preset=NAME`)."""

SPEC = register_spec(TaskSpec(
    name="protein_sedd",
    task="trainer.families.protein_sedd.task:ProteinSEDDTask",
    config_cls=ProteinSEDDConfig,
    presets=PRESETS,
    unit="tokens",
    metrics=("loss", "nelbo_per_token", "perplexity_bound", "num_sequences", "num_unique", "unigram_perplexity"),
    sample_config_cls=ProteinSampleConfig,
    requires=("isal",),
    extra="protein_sedd",
    baselines={"perplexity_bound": "unigram_perplexity"},  # trainer plot: the no-context baseline in the same panel
))
