"""Run manifest: loading, specific errors, canonical hash."""

from __future__ import annotations

import warnings

import pytest

from stages import Manifest, ManifestError, diff_manifests, load_manifest, manifest_from_dict, manifest_hash
from stages.manifest import ManifestDeprecationWarning


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
    # a dense run does not use k, so it is not range-checked (as compression_rate was not)
    assert test_manifest.replace(model={"d_model": 4, "n_heads": 1}, subspace={"enabled": False, "k": 8}).k == 4
    with pytest.raises(ManifestError, match=r"subspace\.k: 65 coordinates per token exceed model\.d_model=64"):
        test_manifest.replace(subspace={"k": 65})


def _with_subspace(manifest: Manifest, **subspace) -> dict:
    data = manifest.to_dict()
    data["subspace"] = {**{n: v for n, v in data["subspace"].items() if n != "k"}, **subspace}
    return data


def test_deprecated_compression_rate_loads_as_k_with_a_warning(default_manifest, test_manifest, tmp_path):
    # the shipped runs as they were written before the rename: compression_rate 32 at d 256, 8 at d 64
    for m, rate in ((default_manifest, 32), (test_manifest, 8)):
        with pytest.warns(ManifestDeprecationWarning) as rec:
            old = manifest_from_dict(_with_subspace(m, compression_rate=rate))
        d = m.model.d_model
        assert [str(w.message) for w in rec] == [
            f'subspace.compression_rate is deprecated: write "k = 8" (d_model {d} // {rate})'
        ]
        assert old == m and old.k == 8
        assert manifest_hash(old) == manifest_hash(m) and diff_manifests(old, m) == []
    # from a file, and k = d_model // rate rounds down like the old rank(): 256 // 30 = 8
    f = tmp_path / "old.toml"
    f.write_text("[model]\nd_model = 256\n[subspace]\ncompression_rate = 30\n")
    with pytest.warns(ManifestDeprecationWarning, match=r'write "k = 8" \(d_model 256 // 30\)'):
        assert load_manifest(f).subspace.k == 8
    # the rate is read against the manifest's d_model, wherever [model] sits in the file
    f.write_text("[subspace]\ncompression_rate = 4\n[model]\nd_model = 128\n")
    with pytest.warns(ManifestDeprecationWarning, match=r'write "k = 32" \(d_model 128 // 4\)'):
        assert load_manifest(f).k == 32
    # shown under Python's default warning filters (a plain DeprecationWarning would be hidden)
    assert issubclass(ManifestDeprecationWarning, FutureWarning)


def test_the_new_key_does_not_warn(default_manifest):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_manifest("default") == default_manifest
        manifest_from_dict(default_manifest.to_dict())


def test_both_keys_must_agree(default_manifest):
    with pytest.warns(ManifestDeprecationWarning, match="repeats subspace.k = 8: remove it"):
        same = manifest_from_dict(_with_subspace(default_manifest, k=8, compression_rate=32))
    assert same == default_manifest
    with pytest.raises(ManifestError) as e:
        manifest_from_dict(_with_subspace(default_manifest, k=16, compression_rate=32))
    assert str(e.value) == (
        "subspace.k = 16 and the deprecated subspace.compression_rate = 32 disagree: the rate means "
        "k = d_model // compression_rate = 256 // 32 = 8; remove compression_rate and keep k"
    )
    # replace() keeps k, so a rate that says otherwise is refused rather than silently ignored
    with pytest.raises(ManifestError, match="disagree"):
        default_manifest.replace(subspace={"compression_rate": 16})


@pytest.mark.parametrize(
    "rate, needle",
    [
        (512, "subspace.k: k = d_model // compression_rate = 256 // 512 = 0 coordinates per token"),
        (0, "subspace.compression_rate: must be >= 1, got 0"),
        ("32", "subspace.compression_rate: expected an integer"),
    ],
)
def test_deprecated_compression_rate_out_of_range_is_refused(default_manifest, rate, needle):
    with pytest.raises(ManifestError) as e:
        manifest_from_dict(_with_subspace(default_manifest, compression_rate=rate))
    assert needle in str(e.value)


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
