"""The reference trainer: the loss falls, resume continues exactly, the CLI runs end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from node.ops import train
from node.ops.local_chain import ResumeError
from stages import load_corpus
from tests.helpers.scripts import ROOT


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="module")
def corpus(test_manifest, cache_dir):
    return load_corpus(test_manifest.data, cache_dir)


@pytest.mark.timeout(120)
def test_loss_falls(test_manifest, corpus, capsys):
    r = train(test_manifest, steps=30, corpus=corpus, progress=True)
    assert r["steps"] == 30 and r["start_step"] == 0 and len(r["loss_history"]) == 30
    assert r["loss_start"] > 4.0  # ~ln(256) = 5.5 at init, falling fast
    assert r["loss_end"] < r["loss_start"] - 0.7, r["loss_history"]
    assert r["val_loss"] < math.log(256) - 1.5
    assert r["val_history"][-1][0] == 30  # validation at the end
    k, boundaries = test_manifest.k, test_manifest.n_stages - 1
    assert r["boundary_bytes_per_token"] == {"fwd": 4 * k * boundaries, "bwd": 4 * k * boundaries}
    assert r["tokens"] == 30 * test_manifest.data.batch_size * test_manifest.model.seq_len
    assert r["tokens_per_s"] > 0
    err = capsys.readouterr().err
    assert "\r" in err and "step 30/30" in err and "tok/s" in err and err.endswith("\n")


@pytest.mark.timeout(120)
def test_checkpoint_resume_continues_exactly(test_manifest, corpus, tmp_path):
    m = test_manifest.replace(train={"checkpoint_every": 3, "val_every": 3, "grad_accum": 2})
    straight = train(m, steps=6, corpus=corpus, checkpoint_dir=tmp_path / "a", quiet=True)
    first = train(m, steps=3, corpus=corpus, checkpoint_dir=tmp_path / "b", quiet=True)
    assert first["steps"] == 3
    resumed = train(m, steps=6, corpus=corpus, checkpoint_dir=tmp_path / "b", resume=True, quiet=True)
    assert resumed["start_step"] == 3 and resumed["steps"] == 6
    assert [s for s, _ in resumed["loss_history"]] == [4, 5, 6]
    assert resumed["loss_history"] == straight["loss_history"][3:]
    assert resumed["val_history"] == straight["val_history"][1:]
    for s1, s2 in zip(straight["stages"], resumed["stages"]):
        for (n, p), (_, q) in zip(s1.named_parameters(), s2.named_parameters()):
            assert torch.equal(p, q), n
    # nothing left to do when already at the target step
    again = train(m, steps=6, corpus=corpus, checkpoint_dir=tmp_path / "b", resume=True, quiet=True)
    assert again["start_step"] == 6 and again["loss_history"] == []
    # a checkpoint of another run is refused, naming the field that differs
    other = m.replace(model={"d_model": 32, "n_heads": 2})
    with pytest.raises(ResumeError, match="model.d_model"):
        train(other, steps=7, corpus=corpus, checkpoint_dir=tmp_path / "b", resume=True, quiet=True)


def _cli_subprocess(args, cache_dir, timeout=180):
    env = dict(os.environ, SWARM_NODE_CACHE=str(cache_dir), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "node.cli", "train-local", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _cli_in_process(args):
    """The subcommand's main with the real parser, minus the process (and its logging setup)."""
    from node.cli import build_parser

    ns = build_parser().parse_args(["train-local", *args])
    return ns._main(ns)


@pytest.mark.timeout(240)
def test_cli_end_to_end(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    ck, jl = tmp_path / "ck", tmp_path / "log.jsonl"
    base = ["--manifest", str(ROOT / "stages" / "runs" / "test.toml"), "--checkpoint-dir", str(ck), "--json-log", str(jl),
            "--device", "cpu", "--no-progress"]
    r = _cli_subprocess([*base, "--steps", "3"], cache_dir)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["start_step"] == 0 and summary["device"] == "cpu"
    assert math.isfinite(summary["loss_end"]) and math.isfinite(summary["val_loss"])
    assert (ck / "ckpt-000000003.safetensors").exists()
    assert "step 3/3" in r.stderr  # plain log lines when not on a terminal
    records = [json.loads(line) for line in jl.read_text().splitlines()]
    assert records[-1]["step"] == 3 and "val_loss" in records[-1]

    monkeypatch.setenv("SWARM_NODE_CACHE", str(cache_dir))
    capsys.readouterr()
    assert _cli_in_process([*base, "--steps", "5", "--resume"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["start_step"] == 3 and summary["steps"] == 5
    assert len(jl.read_text().splitlines()) > len(records)  # appended

    from node.base import CliError

    for args, message in [
        (["--manifest", "test", "--resume"], "--resume needs --checkpoint-dir"),
        (["--manifest", "test", "--device", "cuda:99"], "--device cuda:99"),
        (["--manifest", "test", "--device", "tpu"], "not a device"),
        (["--manifest", "test", "--device", "mps"], "unsupported"),
        (["--manifest", str(tmp_path / "missing.toml")], "manifest file not found"),
        (["--manifest", "test", "--steps", "0"], "--steps must be positive"),
    ]:
        with pytest.raises(CliError, match=message):
            _cli_in_process(args)


@pytest.mark.timeout(120)
def test_architecture_warmup_locks_then_unlocks(test_manifest, corpus):
    from stages import build_stage

    m = test_manifest.replace(warmup={"enabled": True, "groups": [[1]], "unlock_steps": [2]})
    init = dict(build_stage(m, 1).named_parameters())
    locked = train(m, steps=2, corpus=corpus, quiet=True)["stages"]
    for n, p in locked[1].named_parameters():  # layer 1 is stage 1's only block: untouched while locked
        assert torch.equal(p, init[n]), n
    assert not torch.equal(locked[0].blocks[0].attn.qkv_proj.weight, build_stage(m, 0).blocks[0].attn.qkv_proj.weight)
    grown = train(m, steps=4, corpus=corpus, quiet=True)["stages"]
    writer = grown[1].blocks[0].attn.out_proj.weight
    assert grown[1].blocks[0].active and writer.abs().sum() > 0
    assert not torch.equal(grown[1].blocks[0].attn.qkv_proj.weight, init["blocks.0.attn.qkv_proj.weight"])


@pytest.mark.timeout(120)
def test_sharpness_tracked_every_n_steps(test_manifest, corpus, tmp_path):
    m = test_manifest.replace(warmup={"sharpness_every": 3})
    log = tmp_path / "train.jsonl"
    r = train(m, steps=6, corpus=corpus, json_log=str(log), log_every=3, quiet=True)
    steps = [s for s, _ in r["sharpness_history"]]
    assert steps == [3, 6]
    assert all(math.isfinite(v) and v > 0 for _, v in r["sharpness_history"])
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [rec["step"] for rec in recs if "sharpness" in rec] == [3, 6]
