"""Atomic checkpoints: round trip, crash leftovers ignored, corrupt newest falls back, retention,
module + optimizer restore gives the identical next step, full disk leaves no partial file."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from torch import nn

from node.base import (
    CheckpointError,
    checkpoint_path,
    flatten_module,
    flatten_optimizer,
    list_checkpoints,
    load_latest_checkpoint,
    restore_module,
    restore_optimizer,
    save_checkpoint,
)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 4, generator=g),
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(float(seed)),
        "ints": torch.arange(5),
    }


def test_round_trip(tmp_path):
    t = _tensors(1)
    path = save_checkpoint(tmp_path, 7, t, {"manifest": "abc", "nested": {"x": [1, 2.5, None]}})
    assert path == checkpoint_path(tmp_path, 7) and path.exists()
    step, back, meta = load_latest_checkpoint(tmp_path)
    assert step == 7 and meta == {"manifest": "abc", "nested": {"x": [1, 2.5, None]}, "step": 7}
    assert set(back) == set(t)
    for k in t:
        assert back[k].dtype == t[k].dtype and torch.equal(back[k], t[k])
    # the file is plain safetensors: readable by any safetensors reader, no pickle
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(path))["w"], t["w"])
    assert load_latest_checkpoint(tmp_path / "empty") is None


def test_shared_storage_is_saved(tmp_path):
    w = torch.randn(4, 4)
    save_checkpoint(tmp_path, 1, {"a": w, "tied": w}, {})
    _, back, _ = load_latest_checkpoint(tmp_path)
    assert torch.equal(back["a"], back["tied"])


def test_crash_leftovers_are_ignored(tmp_path):
    save_checkpoint(tmp_path, 10, _tensors(10), {})
    # a crash mid-write leaves a temp file (never under a checkpoint name) ...
    stray = tmp_path / ".ckpt-000000020.safetensors.tmp.999999999"
    stray.write_bytes(checkpoint_path(tmp_path, 10).read_bytes()[:50])
    # ... and a truncated file under a checkpoint name (e.g. copied by hand, or a broken disk)
    good = checkpoint_path(tmp_path, 10).read_bytes()
    checkpoint_path(tmp_path, 30).write_bytes(good[: len(good) // 2])
    step, back, _ = load_latest_checkpoint(tmp_path)
    assert step == 10 and torch.equal(back["w"], _tensors(10)["w"])
    # the next save removes the temp file of the dead writer
    save_checkpoint(tmp_path, 40, _tensors(40), {}, keep=5)
    assert not stray.exists()
    assert load_latest_checkpoint(tmp_path)[0] == 40


def test_corrupt_newest_falls_back_with_warning(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _tensors(1), {"v": 1})
    newest = save_checkpoint(tmp_path, 2, _tensors(2), {"v": 2})
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the tensor data: the header still parses
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="swarm_node.checkpoint"):
        step, back, meta = load_latest_checkpoint(tmp_path)
    assert step == 1 and meta["v"] == 1 and torch.equal(back["w"], _tensors(1)["w"])
    assert "checksum mismatch" in caplog.text and newest.name in caplog.text
    newest.write_bytes(b"\x00" * 3)  # not even a header
    assert load_latest_checkpoint(tmp_path)[0] == 1


def test_retention_keeps_newest(tmp_path):
    for s in (5, 10, 15, 20, 25):
        save_checkpoint(tmp_path, s, _tensors(s), {}, keep=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [25, 20, 15]
    save_checkpoint(tmp_path, 30, _tensors(30), {})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 25, 20]


def test_full_disk_raises_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _tensors(1), {})
    before = sorted(p.name for p in tmp_path.iterdir())

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="no space left.*previous checkpoints are intact"):
        save_checkpoint(tmp_path, 2, _tensors(2), {})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert load_latest_checkpoint(tmp_path)[0] == 1


def test_bad_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="not JSON"):
        save_checkpoint(tmp_path, 1, {}, {"f": object()})
    with pytest.raises(CheckpointError, match="not a tensor"):
        save_checkpoint(tmp_path, 1, {"x": [1, 2]}, {})
    assert list_checkpoints(tmp_path) == []


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def _step(net, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_module_and_optimizer_restore_gives_identical_next_step(tmp_path, opt_name):
    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))

    def make():
        net = _Net()
        groups = [{"params": [net.a.weight, net.b.weight], "weight_decay": 0.1},
                  {"params": [p for n, p in net.named_parameters() if not n.endswith("weight") or "norm" in n],
                   "weight_decay": 0.0, "lr_scale": 0.5}]
        if opt_name == "adamw":
            return net, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
        return net, torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True)

    net, opt = make()
    for _ in range(3):
        _step(net, opt, x, y)
    net.count += 3
    ot, om = flatten_optimizer(opt)
    save_checkpoint(tmp_path, 3, {**flatten_module(net), **ot}, {"optim": om})

    net2, opt2 = make()  # fresh, different init
    step, tensors, meta = load_latest_checkpoint(tmp_path)
    restore_module(net2, tensors)
    restore_optimizer(opt2, tensors, meta["optim"])
    assert step == 3 and net2.count.item() == 3
    assert opt2.param_groups[1]["lr_scale"] == 0.5
    if opt_name == "adamw":
        assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    l1, l2 = _step(net, opt, x, y), _step(net2, opt2, x, y)
    assert l1 == l2
    for (n, p), (_, q) in zip(net.named_parameters(), net2.named_parameters()):
        assert torch.equal(p, q), n


def test_restore_into_wrong_model_is_a_clear_error(tmp_path):
    net = _Net()
    save_checkpoint(tmp_path, 1, flatten_module(net), {})
    _, tensors, _ = load_latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not match this model"):
        restore_module(nn.Linear(6, 16), tensors)
    other = _Net()
    other.b = nn.Linear(16, 4)
    with pytest.raises(CheckpointError, match="shape"):
        restore_module(other, tensors)
