"""`protein_sedd`: Score Entropy Discrete Diffusion (Lou, Meng, Ermon 2024) on protein sequences.

Diffusion state space: the 25 residue letters of the tokenizer (20 canonical + X B Z U O), one
padding state (never counted in the loss, never attended to), and for the absorbing graph the mask
state last. Training crops a random window of `max_length` residues, drawn from (seed, epoch,
sample index) so that a resumed run crops exactly as the original; the loss draws each sequence's
diffusion time and corruption from the micro-batch's `SampleRandom` (keyed by the sample: the same at any
world size, batch split or padded length); eval uses the first
`max_length` residues and draws its diffusion times from a generator per sample, so the eval
NELBO is the same whatever the world size or batch size. Each eval sequence averages `eval_draws`
diffusion times spread evenly over (sampling_eps, 1) from one random offset (stratified Monte Carlo:
the same expectation as one draw, a much smaller spread), and the unigram baseline is the
cross-entropy of the training residue frequencies on those same held-out residues. Every such seed is
`trainer.seeding.derive_seed` of its keys. Without validation sequences (`val_fraction=0`, or too
few records) there is no eval set: the run trains, checkpoints and says so in the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.data.arrow_cache import (
    ListColumn,
    cache_root,
    column_array,
    digest,
    file_entries,
    file_keys,
    read_meta,
    selected_column,
    selected_rows,
    write_meta,
)
from trainer.data.build_lock import default_cache_folder
from trainer.data.prepare import human_size
from trainer.errors import DataError
from trainer.families.protein_sedd.dataset import (
    FORMAT_VERSION,
    build_fasta_dataset,
    default_protein_fasta,
    select_split,
    stream_fasta,
    tokenize_dataset,
)
from trainer.families.protein_sedd.ddit import DDIT_PRESETS, DDiT
from trainer.families.protein_sedd.fasta import SplitCounts
from trainer.families.protein_sedd.sedd import build_diffusion_graph, build_noise, score_entropy_loss
from trainer.families.protein_sedd.spec import SPEC, ProteinSampleConfig, ProteinSEDDConfig
from trainer.families.protein_sedd.tokenizer import FIRST_RESIDUE_ID, RESIDUES, VOCAB_SIZE, build_protein_tokenizer
from trainer.registry import register_task
from trainer.seeding import derive_rng, derive_seed
from trainer.task import LossOutput, Task, TaskData

if TYPE_CHECKING:
    from trainer.sample_random import SampleRandom

NUM_RESIDUES = len(RESIDUES)
PAD_STATE = NUM_RESIDUES  # the state after the residues; the mask (absorbing graph) comes last
SEP_STATE = NUM_RESIDUES + 1  # with task.packing: the separator between packed sequences
REFERENCE_ROWS = 10_000
"""Streaming without validation sequences: the first rows that give the reference statistics."""
STATS_VERSION = 1
"""Bump when the statistics sidecar's content changes, so that old sidecars are not read."""
PREPARE_WARN_BYTES = 64 << 20
"""Inputs from this size up log a WARNING when a job converts them (below it the conversion takes seconds and
the note is INFO): `trainer data prepare` does it ahead of the job."""

logger = logging.getLogger(__name__)


def residue_states(token_ids: np.ndarray) -> np.ndarray:
    """Tokenizer ids of residues -> diffusion states 0..24."""
    return token_ids.astype(np.int64) - FIRST_RESIDUE_ID


def crop_start(rng: np.random.Generator, length: int, max_length: int, start_share: float) -> int:
    """First residue of a training window: 0 with probability `start_share` (the N-terminal window that
    eval scores), else uniform over every window of `max_length` residues."""
    if length <= max_length:
        return 0
    start = int(rng.integers(0, length - max_length + 1))  # drawn first: start_share=0 crops as before
    return 0 if start_share > 0 and rng.random() < start_share else start


class ProteinStream:
    """Training crops from a FASTA stream (`trainer.task.GlobalStream`: the core shards it by the record's
    index in the stream); the window is drawn from (seed, epoch, sequence id)."""

    def __init__(self, stream, max_length: int, seed: int, start_share: float = 0.0):
        self.stream, self.max_length, self.seed, self.epoch = stream, max_length, seed, 0
        self.start_share = start_share

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def iter_global(self, wanted: Callable[[int], bool]) -> Iterator[dict[str, Any] | None]:
        for record in self.stream.iter_global(wanted):
            yield None if record is None else self.crop(record)

    def crop(self, record: dict[str, Any]) -> dict[str, Any]:
        seq = record["input_ids"]
        start = 0
        if len(seq) > self.max_length:
            rng = derive_rng("protein_sedd/stream-crop", self.seed, self.epoch, record["id"])
            start = crop_start(rng, len(seq), self.max_length, self.start_share)
        return {"states": residue_states(seq[start:start + self.max_length]), "index": -1}


class ProteinCrops(Dataset):
    """Tokenized sequences as fixed-size crops; `get_item(i, epoch)` draws the training window."""

    def __init__(self, tokenized, max_length: int, seed: int, random_crop: bool, start_share: float = 0.0):
        self.ids = tokenized.with_format("numpy", columns=["input_ids"])
        self.max_length = max_length
        self.seed = seed
        self.random_crop = random_crop
        self.start_share = start_share
        self._rows = ListColumn(tokenized, "input_ids")

    def __getstate__(self) -> dict[str, Any]:
        # the reader's arrays view the Arrow buffers: a worker re-opens them from the dataset instead
        return {k: v for k, v in self.__dict__.items() if k != "_rows"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rows = ListColumn(self.ids, "input_ids")

    def __len__(self) -> int:
        return len(self.ids)

    def get_item(self, index: int, epoch: int = 0) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)}")
        seq = self._rows[index % len(self)]
        start = 0
        if self.random_crop and len(seq) > self.max_length:
            rng = derive_rng("protein_sedd/crop", self.seed, epoch, index)
            start = crop_start(rng, len(seq), self.max_length, self.start_share)
        return {"states": residue_states(seq[start:start + self.max_length]), "index": index}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_item(index)


class PackedBlocks(Dataset):
    """Training sequences in a seeded order, each followed by SEP_STATE, concatenated and cut into blocks
    of `max_length` states (the tail shorter than a block is dropped and logged).

    Only the packed order and offsets are held (a few integers per sequence); a block is assembled on
    access from the dataset's memory-mapped Arrow values, so no process copies the residues.
    """

    def __init__(self, tokenized, max_length: int, seed: int):
        self.dataset, self.max_length = tokenized, max_length
        # Per sequence only its table row (int32 where it fits) and where it ends (int64) are kept; the lengths,
        # the order and the split's selection are temporaries, narrowed as soon as they are made (the peak of
        # this constructor is paid by every process too).
        lengths = selected_column(tokenized, "length").to_numpy()  # == len(input_ids): one id per residue
        index_dtype = np.int32 if len(tokenized.with_format(None).data) < 2**31 else np.int64
        order = derive_rng("protein_sedd/packing", seed).permutation(len(lengths)).astype(index_dtype)
        rows = selected_rows(tokenized)
        if rows is None:
            self.rows = order  # the table row of each packed sequence, in packed order
        else:
            rows = rows.astype(index_dtype)
            self.rows = rows[order]
        del rows
        self.ends = np.cumsum(lengths[order] + 1, dtype=np.int64)  # where each sequence's separator ends
        del lengths, order
        self._column = ListColumn(tokenized, "input_ids")
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.num_blocks = total // max_length
        self.dropped_tokens = total - self.num_blocks * max_length

    def __getstate__(self) -> dict[str, Any]:
        # the reader's arrays view the Arrow buffers: a worker re-opens them from the dataset instead
        return {k: v for k, v in self.__dict__.items() if k != "_column"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._column = ListColumn(self.dataset, "input_ids")

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        index %= self.num_blocks
        lo, hi = index * self.max_length, (index + 1) * self.max_length
        states = np.full(self.max_length, SEP_STATE, dtype=np.int64)
        k = int(np.searchsorted(self.ends, lo, side="right"))  # the first sequence whose span reaches past lo
        while k < len(self.ends):
            start = int(self.ends[k - 1]) if k else 0
            if start >= hi:
                break
            seq = self._column.table_row(int(self.rows[k]))
            a, b = max(start, lo), min(start + len(seq), hi)  # the residues inside the block (none: just its separator)
            if a < b:
                states[a - lo:b - lo] = residue_states(seq[a - start:b - start])
            k += 1
        return {"states": states, "index": index}


def collate_crops(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad to the longest crop of the batch; `num_tokens` is a host int (no device sync to read it)."""
    longest = max(len(s["states"]) for s in samples)
    states = torch.full((len(samples), longest), PAD_STATE, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.bool)
    for row, s in enumerate(samples):
        states[row, : len(s["states"])] = torch.from_numpy(s["states"])
        mask[row, : len(s["states"])] = True
    return {"states": states, "mask": mask, "index": torch.tensor([s["index"] for s in samples]),
            "num_tokens": int(mask.sum())}


@register_task(SPEC)  # options, presets, unit, metrics and sampling options: spec.py
class ProteinSEDDTask(Task):
    cfg: ProteinSEDDConfig

    def __init__(self, cfg: ProteinSEDDConfig, seed: int = 0):
        super().__init__(cfg, seed)  # checks the options (ProteinSEDDConfig.validate)
        states = NUM_RESIDUES + 1 + (1 if cfg.packing else 0)  # residues, pad, separator
        self.graph = build_diffusion_graph(cfg.graph, states + (1 if cfg.graph == "absorb" else 0))
        self.noise = build_noise(cfg.noise)

    def build_model(self, stats: dict[str, Any]) -> nn.Module:
        if self.cfg.model_preset not in DDIT_PRESETS:
            raise ValueError(f"unknown task.model_preset '{self.cfg.model_preset}'; choose from {sorted(DDIT_PRESETS)}")
        return DDiT(vocab_size=self.graph.dim, dropout=self.cfg.dropout, absorbing=self.cfg.graph == "absorb",
                    scale_by_sigma=self.cfg.graph == "absorb", **DDIT_PRESETS[self.cfg.model_preset])

    def build_data(self) -> TaskData:
        c = self.cfg
        path, records = self._load_records()
        val = tokenize_dataset(select_split(records, "validation"))
        if len(val):
            eval_set = ProteinCrops(val, c.max_length, self.seed, random_crop=False)
        else:
            eval_set = None
            level = logging.INFO if c.val_fraction == 0 else logging.WARNING  # asked for, or too few records
            logger.log(level, "%s: no validation sequences (task.val_fraction=%s): no evaluation, checkpoints on "
                       "schedule and at the end only", path, c.val_fraction)
        if c.streaming:
            train_set = ProteinStream(stream_fasta(path, split="train", columns=["id", "input_ids"],
                                                   with_input_ids=True, **common_stream(self._common())),
                                      c.max_length, self.seed, c.start_crop_share)
            stats = self._statistics(path, records, val, None)
        else:
            train = tokenize_dataset(select_split(records, "train"))
            train_set = (PackedBlocks(train, c.max_length, self.seed) if c.packing
                         else ProteinCrops(train, c.max_length, self.seed, random_crop=True,
                                       start_share=c.start_crop_share))
            if isinstance(train_set, PackedBlocks):
                logger.info("packing: %d training blocks of %d states; the last %d states (shorter than a block) "
                            "are left out", len(train_set), c.max_length, train_set.dropped_tokens)
            stats = self._statistics(path, records, val, train)
        return TaskData(train=train_set, eval=eval_set, stats=stats)

    def prepare_data(self) -> dict[str, Any]:
        """The Arrow cache, its split selections and the statistics sidecar, without the per-run parts (the
        packing order, crops, the stream): what `trainer data prepare` builds ahead of a job."""
        c = self.cfg
        path, records = self._load_records(advise=False)
        val = tokenize_dataset(select_split(records, "validation"))
        train = None if c.streaming else tokenize_dataset(select_split(records, "train"))
        self._statistics(path, records, val, train)
        files = {f["filename"] for ds in (records, val, train) if ds is not None for f in ds.cache_files}
        files.add(str(self._stats_path(path, train is None)))
        return {"records": {"train": self.data_stats.train, "validation": len(val)},
                "cache_files": sorted(files), "cache_dir": str(Path(records.cache_files[0]["filename"]).parent.parent)}

    def _common(self) -> dict[str, Any]:
        """The reader settings of `build_fasta_dataset` (and, less cache_dir, of the stream). Without
        task.cache_dir the caches go where the build lock is ($TRAINER_CACHE_DIR, else the `datasets` cache), so
        that the lock spans the same nodes as the caches it guards."""
        c = self.cfg
        return dict(cache_dir=c.cache_dir or str(default_cache_folder()), val_fraction=c.val_fraction,
                    min_length=c.min_length, nonstandard=c.nonstandard)

    def _load_records(self, advise: bool = True) -> tuple[str, Any]:
        """(the FASTA path, every record of its Arrow cache). A missing statistics sidecar means that this
        input and these settings have not been prepared: the conversion runs now, and (`advise`: in a run) a
        big file says how to run it ahead of the job instead."""
        c = self.cfg
        path = c.data_path or str(default_protein_fasta())
        if advise and Path(path).exists() and not self._stats_path(path, c.streaming).is_file():
            size = sum(e["size"] for e in file_entries(path))
            logger.log(logging.WARNING if size >= PREPARE_WARN_BYTES else logging.INFO,
                       "%s (%s): not prepared for these settings: converting it to Arrow shards and counting its "
                       "statistics in this job (a first run does it once per cache; the other processes wait). "
                       "`trainer data prepare CONFIG` (the same overrides) builds them ahead of a job, so GPUs do "
                       "not wait", path, human_size(size))
        records, self.data_stats = build_fasta_dataset(path, **self._common())
        logger.info("%s: %s", path, self.data_stats.summary())
        if not self.data_stats.train:
            raise DataError(f"{path}: no training sequences (task.val_fraction={c.val_fraction}, "
                            f"task.min_length={c.min_length}, task.nonstandard={c.nonstandard}): "
                            f"{self.data_stats.summary()}")
        return path, records

    def _stats_path(self, path: str, streaming: bool) -> Path:
        """The statistics sidecar of this input (its files' content, as the Arrow cache key) and of the
        settings the statistics depend on."""
        c = self.cfg
        key = digest({"version": STATS_VERSION, "format": FORMAT_VERSION, "input": file_keys(path),
                      "settings": common_stream(self._common()), "max_length": c.max_length,
                      "reference": "validation-or-first-rows" if streaming else "train"})
        return cache_root(self._common()["cache_dir"], "protein_stats") / f"{key}.json"

    def _statistics(self, path: str, records, val, train) -> dict[str, Any]:
        """The task statistics (unigram baseline, composition, length histogram) of the training data, kept in a
        sidecar that the first build writes (inside the build lock). They come from the per-split sums the
        conversion counted (`FastaStats.splits`): no pass over the data. `train` None (streaming): the reference
        is the validation split, or without one the first `REFERENCE_ROWS` records (a hash-chosen subset of the
        same distribution, without materialising the training split), counted from those rows."""
        c = self.cfg
        sidecar = self._stats_path(path, train is None)
        meta = read_meta(sidecar)
        if meta is None or "residue_counts" not in meta or "length_counts" not in meta:
            name = "train" if train is not None else "validation" if len(val) else None
            summed = (self.data_stats.splits or {}).get(name) if name is not None else None
            if summed is not None:
                counts, length_counts = split_statistics(summed, c.max_length)
            else:  # the first rows (streaming without validation records), or stats without the sums
                if train is not None:
                    reference = train
                else:
                    reference = val if len(val) else records.select(range(min(len(records), REFERENCE_ROWS)))
                counts = residue_counts(reference)
                lengths, per_length = np.unique(np.minimum(column_array(reference, "length"), c.max_length),
                                                return_counts=True)
                length_counts = {str(int(n)): int(k) for n, k in zip(lengths, per_length)}
            meta = {"input": path, "residue_counts": counts.astype(np.int64).tolist(), "length_counts": length_counts}
            write_meta(sidecar, meta)
        return task_statistics(np.asarray(meta["residue_counts"], dtype=np.float64), meta["length_counts"])

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_crops(samples)

    def unit_sizes(self, dataset: Dataset) -> np.ndarray | None:
        """Tokens of each training crop (data.batching=budget: length-bucketed token-budget batches)."""
        if isinstance(dataset, PackedBlocks):
            return np.full(len(dataset), dataset.max_length, dtype=np.int32)  # 4 bytes a block, as the crops'
        if not isinstance(dataset, ProteinCrops):
            return None
        lengths = selected_column(dataset.ids, "length").to_numpy()  # in the split's row order
        return np.minimum(lengths, dataset.max_length)

    def batch_weight(self, batch: dict[str, Any]) -> int:
        """Tokens, or sequences with task.loss_reduction=sequence_sum (the step's loss is then their mean)."""
        return batch["num_tokens"] if self.cfg.loss_reduction == "token" else int(batch["states"].shape[0])

    def loss(self, model: nn.Module, batch: dict[str, Any], rng: SampleRandom) -> LossOutput:
        """The score-entropy loss at one diffusion time per sequence: t from the row's "time" stream, the
        corruption of each position from its "corrupt" stream (prefix-stable: padding does not change it)."""
        states, eps = batch["states"], self.cfg.sampling_eps
        t = eps + (1 - eps) * rng.rand("time", device=states.device)
        per_seq, tokens = score_entropy_loss(model, self.graph, self.noise, states, t=t,
                                             loss_mask=batch["mask"], attention_mask=batch["mask"],
                                             sampling_eps=eps, generator=rng.generators("corrupt"))
        if self.cfg.loss_reduction == "sequence_sum":
            return LossOutput(loss=per_seq.mean())
        return LossOutput(loss=per_seq.sum() / tokens.sum())

    def eval_step(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per sequence: the NELBO (summed over its residues) averaged over `eval_draws` stratified diffusion
        times, all drawn from the sequence's own generator, and the unigram baseline's cost of the same residues."""
        states, mask = batch["states"], batch["mask"]
        generators = [torch.Generator(states.device).manual_seed(derive_seed("protein_sedd/eval", self.cfg.eval_seed, i))
                      for i in batch["index"].tolist()]
        draws, eps = self.cfg.eval_draws, self.cfg.sampling_eps
        offset = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators]).to(states.device)
        nelbo = torch.zeros(states.shape[0], device=states.device)
        for k in range(draws):
            t = eps + (1 - eps) * (k + offset) / draws
            per_seq, tokens = score_entropy_loss(model, self.graph, self.noise, states, t=t, loss_mask=mask,
                                                 attention_mask=mask, sampling_eps=eps, generator=generators)
            nelbo += per_seq.float()
        values = {"nelbo_sum": nelbo / draws, "tokens": tokens.float(), "index": batch["index"]}
        if "unigram_log_probs" in self.stats:
            log_q = torch.tensor(self.stats["unigram_log_probs"], device=states.device)
            residues = torch.where(mask, states, torch.zeros_like(states)).clamp(max=NUM_RESIDUES - 1)
            values["unigram_sum"] = -(log_q[residues] * mask).sum(-1)
        return values

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        tokens = values["tokens"].double().sum()
        nelbo = float(values["nelbo_sum"].double().sum() / tokens)
        metrics = {"loss": nelbo, "nelbo_per_token": nelbo, "perplexity_bound": math.exp(min(nelbo, 50.0)),
                   "num_sequences": float(len(values["index"])), "num_unique": float(values["index"].unique().numel())}
        if "unigram_sum" in values:  # the training frequencies' cross-entropy on the same held-out residues
            metrics["unigram_perplexity"] = math.exp(float(values["unigram_sum"].double().sum() / tokens))
        elif "unigram_perplexity" in self.stats:  # a run saved before unigram_log_probs: the training entropy
            metrics["unigram_perplexity"] = self.stats["unigram_perplexity"]
        return metrics

    def save_artifacts(self, directory: Path) -> list[str]:
        build_protein_tokenizer().save_pretrained(str(directory / "tokenizer"))
        return ["tokenizer"]

    def generate(self, model: nn.Module, generators: list[torch.Generator],
                 options: ProteinSampleConfig, indices: Sequence[int] = ()) -> list[str]:
        """One sequence per generator. Its length is `options.length`, or drawn from the training crops'
        length histogram with the same generator; all randomness of sample k comes from generators[k]."""
        from trainer.families.protein_sedd.sedd import sample_one_per_generator

        if options.sampler not in ("analytic", "euler"):
            raise ValueError(f"sampler must be 'analytic' or 'euler', got {options.sampler!r}")
        device = next(model.parameters()).device
        if options.length <= 0:
            histogram = self.stats.get("length_histogram")
            if not histogram:
                raise ValueError("the run has no training length histogram (task_stats.json): pass length=N")
            train_lengths = np.repeat([int(n) for n in histogram], list(histogram.values()))
            picks = [int(torch.randint(len(train_lengths), (1,), generator=g, device=g.device)) for g in generators]
            lengths = [int(train_lengths[i]) for i in picks]
        else:
            lengths = [options.length] * len(generators)
        steps, sampler = options.steps, options.sampler
        allowed = torch.zeros(self.graph.dim, dtype=torch.bool, device=device)
        allowed[:NUM_RESIDUES] = True
        out: list[str | None] = [None] * len(generators)
        for size in sorted(set(lengths)):  # one batch per length, each row still driven by its own generator
            rows = [i for i, n in enumerate(lengths) if n == size]
            states = sample_one_per_generator(model, self.graph, self.noise, [generators[i] for i in rows], size,
                                              steps or size, predictor=sampler, allowed_states=allowed, device=device)
            for row, seq in zip(rows, states.tolist()):
                out[row] = "".join(RESIDUES[s] for s in seq)
        return out  # type: ignore[return-value]

    def write_samples(self, sequences: list[str], options: ProteinSampleConfig, out: Path) -> dict[str, Any]:
        """FASTA of the samples plus statistics: lengths, residue composition and its KL to the training data."""
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            for k, seq in enumerate(sequences):
                f.write(f">sample_{k} length={len(seq)}\n")
                for start in range(0, len(seq), 60):
                    f.write(seq[start:start + 60] + "\n")
        return self.sample_statistics(sequences)

    def score_samples(self, sequences: list[str], options: ProteinSampleConfig) -> dict[str, float]:
        """Mean length and the KL of the samples' residue composition to the training one."""
        stats = self.sample_statistics(sequences)
        scores = {"mean_length": stats["lengths"]["mean"]}
        if "kl_samples_to_training" in stats:
            scores["kl_samples_to_training"] = stats["kl_samples_to_training"]
        return scores

    def sample_statistics(self, sequences: list[str]) -> dict[str, Any]:
        """Lengths, residue composition and its KL divergence to the training composition."""
        counts = np.array([sum(seq.count(r) for seq in sequences) for r in RESIDUES], dtype=np.float64)
        composition = counts / max(counts.sum(), 1)
        stats: dict[str, Any] = {
            "lengths": {"min": min(map(len, sequences)), "max": max(map(len, sequences)),
                        "mean": float(np.mean([len(s) for s in sequences])),
                        "histogram": {int(n): int(c) for n, c in zip(*np.unique([len(s) for s in sequences],
                                                                                 return_counts=True))}},
            "composition": dict(zip(RESIDUES, composition.round(5).tolist())),
        }
        if "train_composition" in self.stats:
            p, q = composition, np.asarray(self.stats["train_composition"])
            support = p > 0
            stats["training_composition"] = dict(zip(RESIDUES, q.round(5).tolist()))
            ratio = p[support] / np.maximum(q[support], 1e-12)
            stats["kl_samples_to_training"] = float((p[support] * np.log(ratio)).sum())
        return stats


def common_stream(common: dict[str, Any]) -> dict[str, Any]:
    """The reader settings shared by the Arrow build and the stream."""
    return {k: v for k, v in common.items() if k != "cache_dir"}


def split_statistics(counts: SplitCounts, max_length: int) -> tuple[np.ndarray, dict[str, int]]:
    """(residue counts, float64 [NUM_RESIDUES]; histogram of min(length, max_length), "length" -> records, in
    increasing length) of a split from the sums the conversion counted: what `residue_counts` and a histogram
    of the split's `length` column give."""
    tokens = np.zeros(VOCAB_SIZE, dtype=np.int64)
    tokens[:min(VOCAB_SIZE, len(counts.token_counts))] = counts.token_counts[:VOCAB_SIZE]
    folded: dict[int, int] = {}
    for n, k in counts.length_counts.items():
        folded[min(n, max_length)] = folded.get(min(n, max_length), 0) + k
    residues = tokens[FIRST_RESIDUE_ID:FIRST_RESIDUE_ID + NUM_RESIDUES].astype(np.float64)
    return residues, {str(n): folded[n] for n in sorted(folded)}


def residue_counts(tokenized) -> np.ndarray:
    """How often each of the 25 residues occurs in a tokenized dataset (one bincount per Arrow chunk)."""
    counts = ListColumn(tokenized, "input_ids").bincount(VOCAB_SIZE)
    return counts[FIRST_RESIDUE_ID:FIRST_RESIDUE_ID + NUM_RESIDUES].astype(np.float64)


def task_statistics(counts: np.ndarray, length_counts: dict[str, int]) -> dict[str, Any]:
    """The task statistics from the training residue counts and the histogram of crop lengths (saved as the run
    artifact task_stats.json: eval and sampling never re-read the training data)."""
    # unigram_log_probs (add-half smoothing: a residue absent from training has a finite cost) score the
    # held-out residues at eval: the baseline on the same tokens as the model's bound.
    return {"unigram_perplexity": perplexity_of(counts),
            "unigram_log_probs": np.log((counts + 0.5) / (counts.sum() + 0.5 * len(counts))).tolist(),
            "train_composition": (counts / counts.sum()).tolist(),
            "length_histogram": {str(int(n)): int(k) for n, k in length_counts.items()}}


def perplexity_of(counts: np.ndarray) -> float:
    """exp(entropy) of a frequency table: the no-context (unigram) baseline perplexity."""
    p = counts[counts > 0] / counts.sum()
    return float(np.exp(-(p * np.log(p)).sum()))
