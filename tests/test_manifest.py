"""Run manifest: loading, specific errors, canonical hash."""

from __future__ import annotations

import pytest

from stages.manifest import (
    Manifest,
    ManifestError,
    diff_manifests,
    load_manifest,
    manifest_from_dict,
    manifest_hash,
)


def test_shipped_manifests_load(default_manifest, test_manifest):
    assert default_manifest.run.id == "swarm-default"
    assert default_manifest.k == 8
    assert default_manifest.n_stages == 3
    assert test_manifest.model.d_model == 64
    assert load_manifest("test") == test_manifest  # shipped name lookup


def test_default_compression_is_at_least_30x(default_manifest):
    assert default_manifest.model.d_model / default_manifest.k >= 30


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model": {"n_heads": 6}}, "model.n_heads: 6 does not divide model.d_model=256"),
        ({"subspace": {"compression_rate": 512}}, "k = d_model // compression_rate"),
        ({"optim": {"name": "lion"}}, "optim.name: unknown optimizer 'lion'"),
        ({"stages": {"layout": [[0, 2], [3, 6]]}}, "layers 2..2 are not covered"),
        ({"stages": {"layout": [[0, 2], [2, 4]]}}, "layers 4..5 are not covered"),
        ({"stages": {"layout": [[0, 3], [2, 6]]}}, "overlapping"),
        ({"stages": {"layout": [[0, 4], [4, 8]]}}, "covers 8 layers but model.n_layers=6"),
        ({"model": {"d_model": "big"}}, "model.d_model: expected an integer"),
        ({"schedule": {"kind": "step"}}, "schedule.kind: unknown schedule"),
        ({"data": {"source": "text"}}, "data.path: required"),
        ({"run": {"protocol_version": 2}}, "run.protocol_version"),
        ({"asyncmesh": {"mode": "sync"}}, "asyncmesh.mode: unknown mode"),
        ({"asyncmesh": {"lookahead_target": "velocity"}}, "asyncmesh.lookahead_target: unknown target"),
        ({"asyncmesh": {"lookahead_horizon": "far"}}, "asyncmesh.lookahead_horizon: unknown horizon"),
        ({"model": {"n_layer": 4}}, "model.n_layer: unknown field"),
        ({"modle": {}}, "unknown manifest section [modle]"),
    ],
)
def test_manifest_errors_are_specific(default_manifest, change, needle):
    data = default_manifest.to_dict()
    for section, values in change.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(ManifestError) as e:
        manifest_from_dict(data)
    assert needle in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(bad)


def test_hash_is_canonical_and_names_differences(default_manifest):
    same = manifest_from_dict(default_manifest.to_dict())
    assert manifest_hash(same) == manifest_hash(default_manifest)
    assert len(manifest_hash(default_manifest)) == 64
    # local-only choices do not change the hash
    local = default_manifest.replace(train={"steps": 5}, data={"batch_size": 3})
    assert manifest_hash(local) == manifest_hash(default_manifest)
    other = default_manifest.replace(model={"d_model": 128}, subspace={"compression_rate": 16})
    assert manifest_hash(other) != manifest_hash(default_manifest)
    assert diff_manifests(default_manifest, other) == ["model.d_model", "subspace.compression_rate"]


def test_defaults_construct():
    m = Manifest()
    assert m.k == m.model.d_model // m.subspace.compression_rate


def test_even_layout_splits_layers_over_stages_by_rounding():
    from stages.manifest import even_layout

    assert even_layout(6, 3) == [[0, 2], [2, 4], [4, 6]]
    assert even_layout(7, 3) == [[0, 2], [2, 5], [5, 7]]
    assert even_layout(3, 1) == [[0, 3]]
    with pytest.raises(ValueError, match="cannot split 2 layers over 3 stages"):
        even_layout(2, 3)
