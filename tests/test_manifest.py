"""Run manifest: loading, specific errors, canonical hash."""

from __future__ import annotations

import pytest

from stages import Manifest, ManifestError, diff_manifests, load_manifest, manifest_from_dict, manifest_hash


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
        ({"subspace": {"k": 0}}, "subspace.k: must be >= 1"),
        ({"subspace": {"k": -3}}, "subspace.k: must be >= 1"),
        ({"subspace": {"k": 257}}, "subspace.k: 257 coordinates per token exceed model.d_model=256"),
        ({"subspace": {"k": 8.0}}, "subspace.k: expected an integer"),
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
        ({"asyncmesh": {"avg_period_s": 0.5}}, "asyncmesh.avg_period_s: must be in [1, 3600] seconds"),
        ({"asyncmesh": {"avg_blend_steps": 0}}, "asyncmesh.avg_blend_steps: must be in [1, 1000]"),
        ({"asyncmesh": {"avg_blend_steps": 2.5}}, "asyncmesh.avg_blend_steps: expected an integer"),
        ({"model": {"n_layer": 4}}, "model.n_layer: unknown field"),
        ({"model": {"vocab_size": 100}}, "model.vocab_size: must be 256, the byte tokenizer's vocabulary"),
        ({"model": {"vocab_size": 300}}, "model.vocab_size: must be 256"),
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
    other = default_manifest.replace(model={"d_model": 128}, subspace={"k": 16})
    assert manifest_hash(other) != manifest_hash(default_manifest)
    assert diff_manifests(default_manifest, other) == ["model.d_model", "subspace.k"]


def test_defaults_construct():
    m = Manifest()
    assert m.k == m.subspace.k == 8 and m.model.d_model == 256


def test_k_is_the_boundary_width_and_a_dense_run_sends_d_model(test_manifest):
    assert test_manifest.subspace.k == test_manifest.k == 8
    assert test_manifest.replace(subspace={"k": 5}).k == 5  # any k in 1..d_model, not only divisors
    dense = test_manifest.replace(subspace={"enabled": False})
    assert dense.k == dense.model.d_model == 64
    # a dense run does not use k, so it is not range-checked
    assert test_manifest.replace(model={"d_model": 4, "n_heads": 1}, subspace={"enabled": False, "k": 8}).k == 4
    with pytest.raises(ManifestError, match=r"subspace\.k: 65 coordinates per token exceed model\.d_model=64"):
        test_manifest.replace(subspace={"k": 65})


def _with_subspace(manifest: Manifest, **subspace) -> dict:
    data = manifest.to_dict()
    data["subspace"] = {**{n: v for n, v in data["subspace"].items() if n != "k"}, **subspace}
    return data


@pytest.mark.parametrize(
    "subspace, d_model, message",
    [
        ({"compression_rate": 32}, 256,
         'subspace.compression_rate was removed: write "k = N" (1 <= N <= 256); '
         "compression_rate = 32 meant k = 256 // 32 = 8"),
        ({"compression_rate": 4}, 128,  # read against the manifest's own d_model
         'subspace.compression_rate was removed: write "k = N" (1 <= N <= 128); '
         "compression_rate = 4 meant k = 128 // 4 = 32"),
        ({"k": 8, "compression_rate": 32}, 256,  # even when it agrees with k
         'subspace.compression_rate was removed: write "k = N" (1 <= N <= 256); '
         "compression_rate = 32 meant k = 256 // 32 = 8"),
        ({"compression_rate": 0}, 256, 'subspace.compression_rate was removed: write "k = N" (1 <= N <= 256)'),
        ({"compression_rate": "32"}, 256, 'subspace.compression_rate was removed: write "k = N" (1 <= N <= 256)'),
    ],
)
def test_the_removed_compression_rate_key_is_refused_naming_k(default_manifest, subspace, d_model, message):
    data = _with_subspace(default_manifest, **subspace)
    data["model"]["d_model"] = d_model
    with pytest.raises(ManifestError) as e:
        manifest_from_dict(data)
    assert str(e.value) == message


def test_the_removed_key_is_refused_from_a_file_and_by_replace(default_manifest, tmp_path):
    f = tmp_path / "old.toml"
    f.write_text("[subspace]\ncompression_rate = 4\n[model]\nd_model = 128\n")
    with pytest.raises(ManifestError, match=r'compression_rate was removed: write "k = N" \(1 <= N <= 128\)'):
        load_manifest(f)
    with pytest.raises(ManifestError, match="compression_rate was removed"):
        default_manifest.replace(subspace={"compression_rate": 16})


def test_shipped_manifest_hashes_are_pinned(default_manifest, test_manifest):
    # organiser signatures and checkpoints are keyed by this hash: a change to consensus_dict or to
    # the shipped runs that moves it must be deliberate (update these values with it)
    assert manifest_hash(default_manifest) == "a102acdd81ab6350868540c798986e4acdb0b92affe2f7787de6c290a7ca59ff"
    assert manifest_hash(test_manifest) == "364d34c70bb065561d9a55b170e10efff08bb13fc9ee8281f42183e845ce0492"
    rebuilt = manifest_from_dict(_with_subspace(default_manifest, k=8))
    assert manifest_hash(rebuilt) == manifest_hash(default_manifest) and diff_manifests(rebuilt, default_manifest) == []


def test_manifest_protocol_version_is_the_wire_protocol_version():
    import protocol.frames
    import stages.manifest

    assert stages.manifest.PROTOCOL_VERSION is protocol.frames.PROTOCOL_VERSION
    assert Manifest().run.protocol_version == protocol.frames.PROTOCOL_VERSION


def test_even_layout_splits_layers_over_stages_by_rounding():
    from stages import even_layout

    assert even_layout(6, 3) == [[0, 2], [2, 4], [4, 6]]
    assert even_layout(7, 3) == [[0, 2], [2, 5], [5, 7]]
    assert even_layout(3, 1) == [[0, 3]]
    with pytest.raises(ValueError, match="cannot split 2 layers over 3 stages"):
        even_layout(2, 3)
