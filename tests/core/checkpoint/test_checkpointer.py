"""The Checkpointer's parts and the topology-free form, in process (no launcher): every part is Stateful,
which layouts need a conversion, a plain checkpoint's round trip through the universal form restores weights
and Adam state exactly, and bad input is one line naming what differs."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY
from safetensors.torch import save_file

from trainer.config import load_config
from trainer.core.checkpoint import convert
from trainer.core.checkpoint.parts import Part, Stateful, TrainState, placement
from trainer.core.samplers import SAMPLE_ORDER
from trainer.errors import CheckpointError


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return model, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                    lr=0.01, fused=True)


def plain_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[list[str]]]:
    """What accelerate writes for a plain or DDP run (model.safetensors, optimizer.bin), after 3 steps."""
    model, opt = model_and_optimizer(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / convert.WEIGHTS))
    torch.save(opt.state_dict(), path / convert.OPTIMIZER)
    return model, opt, convert.optimizer_param_names(model, opt)


def test_every_part_is_stateful(tmp_path, fresh_accelerate):
    from trainer.core.trainer import Trainer

    cfg = load_config(TINY, ["train.max_steps=1", "ckpt.every_steps=0", "log.tensorboard=false",
                             "log.progress_bar=false", f"run.output_dir={tmp_path}", "train.ema_decay=0.9"])
    trainer = Trainer(cfg)
    parts = trainer.checkpointer
    # Every part in the one mapping that save and resume go through.
    assert set(parts.parts) == {"train", "rng", "backend", "data", "scheduler", "step_guard", "task_stats", "ema"}
    for part in parts.parts.values():
        assert isinstance(part, Stateful), part
    # The RNG part reads its files before the backend's loader runs (which would swallow a failure).
    assert list(parts.parts).index("rng") < list(parts.parts).index("backend")
    # Model and optimizer live in the backend's own files, which the part writes and reads (or converts) itself.
    assert isinstance(parts.backend, Part)
    assert {placement(p).file for p in parts.parts.values()} == {None, "task_stats.json", "ema.safetensors"}
    assert isinstance(TrainState(), Stateful)


@pytest.mark.parametrize("saved, now, converts", [
    (("MULTI_CPU", 2, 0), ("NO", 1, 0), False),           # accelerate loads DDP at any world size
    (("DEEPSPEED", 2, 2), ("DEEPSPEED", 2, 2), False),    # DeepSpeed's own files, same layout
    (("DEEPSPEED", 2, 2), ("DEEPSPEED", 1, 2), True),     # another number of DeepSpeed processes
    (("DEEPSPEED", 2, 2), ("DEEPSPEED", 2, 3), True),     # another ZeRO stage
    (("DEEPSPEED", 2, None), ("DEEPSPEED", 2, 1), False),  # an older ZeRO-1/2 checkpoint: the same files
    (("MULTI_CPU", 2, 0), ("DEEPSPEED", 2, 2), True),
    (("DEEPSPEED", 2, 3), ("MULTI_CPU", 2, 0), True),
    (("FSDP", 2, 0), ("FSDP", 4, 0), False),             # DCP's shards: DCP reshards them
    (("FSDP", 2, 0), ("NO", 1, 0), True),                # converted on demand for any other backend
    (("FSDP", 2, 0), ("MULTI_CPU", 2, 0), True),
    (("FSDP", 2, 0), ("DEEPSPEED", 2, 2), True),
    (("MULTI_CPU", 2, 0), ("FSDP", 2, 0), False),        # whole tensors: each FSDP rank takes its shards
])
def test_which_layouts_need_a_conversion(saved, now, converts):
    record = {"backend": saved[0], "world_size": saved[1], "zero_stage": saved[2]}
    assert convert.needs_conversion(record, *now) is converts


def test_older_whole_tensor_fsdp_checkpoints_read_as_plain_ones():
    assert not convert.needs_conversion({"backend": "FSDP", "world_size": 2, convert.FULL_STATE: True}, "NO", 1, 0)


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_dcp_checkpoint_reads_whole_and_its_metadata_pickle_is_restricted(tmp_path):
    """A sharded FSDP checkpoint's DCP folder read on one process (the on-demand conversion, export); a payload
    planted in its pickled .metadata is refused in one line and never runs."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    model, opt, names = plain_checkpoint(tmp_path / "plain")
    named = {"state": {n: s for n, s in zip([n for g in names for n in g], opt.state_dict()["state"].values())},
             "param_groups": [{**g, "params": n} for g, n in zip(opt.state_dict()["param_groups"], names)]}
    for folder, state in ((convert.FSDP_MODEL, {"model": model.state_dict()}),
                          (convert.FSDP_OPTIMIZER, {"optimizer": named})):
        _save_state_dict(state, storage_writer=FileSystemWriter(str(tmp_path / "ckpt" / folder)), no_dist=True)
    weights, optim = convert.sharded_fsdp_state(tmp_path / "ckpt", names)
    for key, value in model.state_dict().items():
        assert torch.equal(weights[key], value), key
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(optim["state"][index][key]), torch.as_tensor(value)), (index, key)
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.1, 0.0]
    shapes, _ = convert.saved_param_shapes(tmp_path / "ckpt", {"backend": "FSDP"})
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}

    marker = tmp_path / "PWNED"
    (tmp_path / "ckpt" / convert.FSDP_MODEL / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(CheckpointError, match=r"refusing to load a torch.distributed.checkpoint .metadata file: "
                                              r"it holds '(posix|os).system'"):
        convert.read_dcp(tmp_path / "ckpt" / convert.FSDP_MODEL)
    assert not marker.exists()


def test_plain_checkpoint_round_trips_through_the_topology_free_form(tmp_path):
    model, opt, names = plain_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "universal"
    convert.convert(tmp_path / "ckpt", out, {"backend": "MULTI_CPU", "param_names": names}, names)
    assert sorted(p.name for p in (out / "zero" / "0.weight").iterdir()) == \
        ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    fresh, fresh_opt = model_and_optimizer(1)
    convert.check_same_model(tmp_path / "ckpt", {"backend": "MULTI_CPU"}, fresh)
    convert.load_into_torch(out, fresh, fresh_opt, names)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    want, got = opt.state_dict(), fresh_opt.state_dict()
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)
    assert [g["weight_decay"] for g in got["param_groups"]] == [0.1, 0.0]
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


def test_another_model_is_named_before_anything_is_converted(tmp_path):
    plain_checkpoint(tmp_path / "ckpt")
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    with pytest.raises(CheckpointError) as raised:
        convert.check_same_model(tmp_path / "ckpt", {"backend": "MULTI_CPU"}, other)
    message = str(raised.value)
    assert "holds another model than this run's: parameter '0.weight' has shape (8, 4) there and (16, 4) here" in message
    assert "\n" not in message


def test_optimizer_state_that_cannot_be_named_is_refused(tmp_path):
    _, _, names = plain_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="the optimizer state cannot be converted"):
        convert.convert(tmp_path / "ckpt", tmp_path / "out", {"backend": "MULTI_CPU"}, [names[0]])


def test_stream_position_is_saved_once_and_an_older_per_rank_one_restarts_its_epoch(caplog):
    """A stream's position is (epoch, global samples read), the same on every rank: one entry, whatever the world
    size. An older checkpoint's per-rank `data_positions` (each rank's own shard) restart the earliest epoch."""
    from trainer.core.checkpoint.parts import DataPosition

    data = SimpleNamespace(streaming=True, position=(2, 64))
    part = DataPosition(data, SimpleNamespace(num_processes=2, process_index=1))
    assert part.state_dict() == {"data_position": [2, 64]}
    data.position = (0, 0)
    part.load_state_dict({"data_position": [2, 64]})
    assert data.position == (2, 64)
    part.load_state_dict({"data_positions": [[2, 4], [3, 1]]})
    assert data.position == (2, 0) and "older format" in caplog.text
    map_style = SimpleNamespace(streaming=False, position=(0, 0))
    assert DataPosition(map_style, None).state_dict() == {"sample_order": SAMPLE_ORDER}  # the step gives the position
