"""Multi-process swarm tests: the manifests they launch."""

from __future__ import annotations


def basic_verifier_manifest(tmp_path):
    """stages/runs/test.toml with the basic verifier (dtype, shape, finite) instead of SENTINEL. Every
    tensor still passes a verifier; SENTINEL's calibration is tested on its own, and one false
    positive there (a 60 s ban) would stall a daemon test for reasons that are not the daemon's."""
    from node.ops import write_manifest
    from stages import load_manifest

    return str(write_manifest(load_manifest("test").replace(sentinel={"enabled": False}),
                              tmp_path / "test-basic.toml"))


def morph_manifest(tmp_path, every: int, name: str = "test-morph.toml"):
    """``basic_verifier_manifest`` with an optimizer that follows a change of basis (Muon for the
    hidden matrices, SGD-momentum for the rest) and ``[morph] every`` (0: off)."""
    from node.ops import write_manifest
    from stages import load_manifest

    m = load_manifest("test").replace(
        sentinel={"enabled": False}, optim={"name": "muon", "lr": 0.02, "aux_optimizer": "sgd", "aux_lr": 0.05},
        morph={"every": every})
    return str(write_manifest(m, tmp_path / name))
