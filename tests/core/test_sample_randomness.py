"""Training randomness keyed by the sample, not by the rank (`trainer.sample_random`, `Task.loss(model, batch, rng)`).

- `SampleRandom`: a row's draws depend on its sample alone (not on the batch it is in, its order, the padding),
  streams differ by name, and the CPU numbers are fixed (stored values).
- Every family's loss draws nothing from the global RNG (what dropout 0 leaves of it), so the rank's RNG
  cannot make ranks differ.
- 1 process (2 micro-batches accumulated) and 2 gloo processes (one micro-batch each) with the same global
  batch end with the same weights up to float summation order, for the families whose loss draws
  (SEDD: diffusion time and corruption; EDM: time and noise); with the per-rank RNG before the
  keying they differed by 1.9e-4 (SEDD) and 3.0e-4 (EDM) in this test.
  GEARS' own test covers it for GEARS (`test_two_processes_match_one_with_the_same_global_batch`), the launch
  matrix for regression; crystals is an extended repeat.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import FAMILY_RUNS, FAMILY_RUNS_COMMON, ROOT, reset_accelerate, task_cache_dir
from safetensors.torch import load_file

from trainer.api import train
from trainer.config import load_config
from trainer.core.trainer import Trainer
from trainer.sample_random import SampleRandom

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
TOLERANCE = 1e-5
"""Largest weight difference (absolute, on weights of order 0.1-1) between 1 and 2 processes after 3 steps."""


@pytest.mark.numerics
def test_rows_depend_on_their_sample_alone():
    seed, indices = 7, [5, 0, 13, 2, 8, 21, 3, 1]
    batch = SampleRandom.for_samples(seed, 4, indices)
    order = [3, 7, 0, 5, 1, 6, 2, 4]
    shuffled = SampleRandom.for_samples(seed, 4, [indices[k] for k in order])
    for k, index in enumerate(indices):
        alone = SampleRandom.for_samples(seed, 4, [index])
        assert torch.equal(alone.rand("time")[0], batch.rand("time")[k])
        assert torch.equal(alone.randn("noise", 6, 3)[0], batch.randn("noise", 6, 3)[k])
        assert torch.equal(alone.randint("t", 0, 1000, 2)[0], batch.randint("t", 0, 1000, 2)[k])
        assert torch.equal(alone.rand("time")[0], shuffled.rand("time")[order.index(k)])
        assert torch.equal(torch.rand(4, generator=alone.generators("mask")[0]),
                           torch.rand(4, generator=batch.generators("mask")[k]))
    assert torch.equal(batch[2:4].rand("time"), batch.rand("time")[2:4])
    # prefix-stable: drawing for a longer padded length leaves a row's first values as they were
    assert torch.equal(batch.rand("mask", 40, 2)[:, :17], batch.rand("mask", 17, 2))
    assert torch.equal(batch.randn("noise", 29, 9)[:, :11], batch.randn("noise", 11, 9))
    # streams, epochs, seeds and samples differ; each call starts its stream afresh
    draws = [batch.rand("time"), batch.rand("noise"), SampleRandom.for_samples(seed, 5, indices).rand("time"),
             SampleRandom.for_samples(seed + 1, 4, indices).rand("time")]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])
    assert len(set(batch.rand("time").tolist())) == len(indices)
    assert torch.equal(batch.rand("time"), batch.rand("time"))
    normals = SampleRandom.for_samples(0, 0, range(64)).randn("noise", 512)
    assert abs(float(normals.mean())) < 0.02 and abs(float(normals.std()) - 1) < 0.02


@pytest.mark.numerics
def test_cpu_numbers_are_fixed():
    """Stored values: the row seeds (`derive_seeds`) and torch's CPU generator must not drift across versions."""
    rng = SampleRandom.for_samples(0, 0, [0, 1])
    assert rng.seeds.tolist() == STORED_SEEDS
    torch.testing.assert_close(rng.rand("time"), torch.tensor(STORED_RAND), rtol=0, atol=1e-7)
    torch.testing.assert_close(rng.randn("noise", 2), torch.tensor(STORED_RANDN), rtol=0, atol=1e-6)
    assert rng.randint("time", 0, 1000).tolist() == STORED_RANDINT
    assert rng.rand("time", device="meta").device.type == "meta"  # drawn on the CPU, then moved


STORED_SEEDS = [6539477605296901000, 6002229014238566213]
STORED_RAND = [0.24762577, 0.50431150]
STORED_RANDN = [[1.7369896, -1.9882690], [0.10955862, 0.15360719]]
STORED_RANDINT = [439, 87]

# ---------------------------------------------------------------------------------------------------- families

ALSO_ONE_PROCESS = {"protein_sedd": ["train.per_device_batch_size=4"]}
"""Further one-process layouts of the same global batch that must train the same weights: other micro-batches
(4 rows, padded to their longest crop), which the per-sample draws do not see."""


def family_config(family: str, out, cache, *overrides: str):
    config, extra = FAMILY_RUNS[family]
    return load_config(str(ROOT / "configs" / config), [*FAMILY_RUNS_COMMON, *extra, f"run.output_dir={out}",
                                                        *task_cache_dir(family, cache),
                                                        *overrides])


@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
@pytest.mark.usefixtures("fresh_accelerate")
def test_the_loss_draws_nothing_from_the_global_rng(family, tmp_path):
    """With dropout 0 a family's loss leaves the global RNG untouched and gives the same value whatever its state:
    what it draws comes from the micro-batch's SampleRandom."""
    trainer = Trainer(family_config(family, tmp_path / "run", tmp_path / "cache"))
    batch, rng = next(trainer.data.micro_batches(0))
    trainer.task.loss(trainer.model, batch, rng)  # a first call may differ in rounding (GEARS builds its graph operators)
    values = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        values.append(trainer.task.loss(trainer.model, batch, rng).loss.detach())
        assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(values[0], values[1])


@pytest.fixture
def plain_process(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)


def final_weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.latest_checkpoint / "model.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Over the weights; BatchNorm's running statistics (eval only) are rank 0's under DDP, which broadcasts its
    buffers, but follow both micro-batches under accumulation: left out."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a
               if a[k].is_floating_point() and not k.endswith(("running_mean", "running_var")))


@pytest.mark.distributed
@pytest.mark.slow
# EDM's 2-process run in `make test` is test_molecules_task.py's (compared with one process accumulating): here an
# extended repeat, as crystals.
@pytest.mark.parametrize("family", ["protein_sedd", pytest.param("molecules_edm", marks=pytest.mark.extended),
                                    pytest.param("crystal_property", marks=pytest.mark.extended)])
@pytest.mark.numerics
def test_two_processes_train_the_weights_of_one(family, tmp_path, plain_process, capsys):
    """The same global batch of 4 (per device 2): 2 gloo processes x 1 micro-batch against 1 process x 2
    accumulated micro-batches (and, for SEDD, 1 process x 1 micro-batch of 4), 3 steps, dropout 0: the final
    weights agree within TOLERANCE (summation order only)."""
    cache = tmp_path / "cache"
    two = train(family_config(family, tmp_path / "two", cache), num_processes=2)
    assert two.world_size == 2
    reference = final_weights(two)
    layouts = [[], *([o] for o in ALSO_ONE_PROCESS.get(family, []))]
    for k, layout in enumerate(layouts):
        try:
            one = train(family_config(family, tmp_path / f"one{k}", cache, *layout))
        finally:
            reset_accelerate()
        difference = max_difference(final_weights(one), reference)
        with capsys.disabled():
            print(f"\n{family} {layout or 'accumulation 2'} x 1 process vs 2 processes: max weight difference "
                  f"{difference:.2e}")
        assert difference <= TOLERANCE, (family, layout, difference)


def test_deepspeed_checkpoint_readers_print_nothing_and_still_raise(capsys):
    """`trainer sample` on N processes: each rank merges a ZeRO checkpoint, and DeepSpeed narrated the merge (lines and
    bars) on each. Its readers run inside `deepspeed_reading`: the chatter is dropped, errors are not."""
    from tqdm.auto import tqdm

    from trainer.core.checkpoint.convert import deepspeed_reading

    stdout, stderr = sys.stdout, sys.stderr
    with deepspeed_reading():
        print("Processing zero checkpoint")
        for _ in tqdm(range(2), desc="Gathering sharded weights"):
            pass
    out, err = capsys.readouterr()
    assert out + err == ""
    with pytest.raises(ValueError, match="broken"), deepspeed_reading():
        raise ValueError("broken shard")
    assert (sys.stdout, sys.stderr) == (stdout, stderr)


def test_fewer_sample_batches_than_processes_is_said():
    from trainer.core.generation import idle_ranks_note, rank_batches

    assert rank_batches(16, 16, 1, 2) == []  # rank 1 has nothing to draw
    assert idle_ranks_note(16, 16, 2) == ("num_samples=16 in batches of 16 is 1 batch(es) for 2 processes: 1 of them "
                                          "idle (batch_size=8 would use all)")
    assert idle_ranks_note(16, 8, 2) is None and idle_ranks_note(16, 16, 1) is None and idle_ranks_note(3, 1, 2) is None
    for samples, batch, world in ((5, 5, 4), (9, 9, 6), (7, 3, 4)):  # the suggested batch size keeps every rank busy
        suggested = int(idle_ranks_note(samples, batch, world).split("batch_size=")[1].split()[0])
        assert all(rank_batches(samples, suggested, rank, world) for rank in range(world)), (samples, batch, world)
    assert idle_ranks_note(1, 16, 2).endswith("(at most 1 can work on 1 samples)")
