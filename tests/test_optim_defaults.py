"""Optimizer defaults: an omitted optim.name is NAdam (docs/REFERENCES.md §2), omitted betas follow the optimizer."""

from __future__ import annotations

import pytest

from stages import Manifest, ManifestError, load_manifest, manifest_hash
from stages.manifest import default_betas, shipped_manifest_path


def _load(tmp_path, optim_lines: str):
    """The shipped test manifest with its [optim] section replaced by ``optim_lines``."""
    text = shipped_manifest_path("test").read_text(encoding="utf-8")
    head, rest = text.split("[optim]", 1)
    tail = rest[rest.index("\n["):]  # the next section onward
    p = tmp_path / "m.toml"
    p.write_text(head + "[optim]\n" + optim_lines + "\n" + tail, encoding="utf-8")
    return load_manifest(p)


def test_omitted_name_is_nadam_with_long_momentum(tmp_path):
    m = _load(tmp_path, "lr = 3e-3")
    assert m.optim.name == "nadam"
    assert m.optim.betas == (0.99, 0.999)
    assert Manifest().optim.name == "nadam" and Manifest().optim.betas == (0.99, 0.999)


@pytest.mark.parametrize("name, betas", [("adamw", (0.9, 0.95)), ("adam", (0.9, 0.95)),
                                         ("nadam", (0.99, 0.999)), ("sgd", (0.9, 0.95)),
                                         ("muon", (0.9, 0.95)), ("numuon", (0.9, 0.95))])
def test_omitted_betas_follow_the_optimizer(tmp_path, name, betas):
    m = _load(tmp_path, f'name = "{name}"')
    assert m.optim.betas == betas == default_betas(name)


def test_explicit_betas_win(tmp_path):
    m = _load(tmp_path, 'name = "nadam"\nbetas = [0.9, 0.95]')
    assert m.optim.betas == (0.9, 0.95)


def test_hash_equal_for_explicit_and_implied_defaults(tmp_path):
    implied = _load(tmp_path, "lr = 3e-3")
    explicit = _load(tmp_path, 'name = "nadam"\nlr = 3e-3\nbetas = [0.99, 0.999]')
    assert implied == explicit
    assert manifest_hash(implied) == manifest_hash(explicit)
    # the resolved value is what is hashed: a different optimizer's betas change the hash
    other = _load(tmp_path, 'name = "nadam"\nlr = 3e-3\nbetas = [0.9, 0.999]')
    assert manifest_hash(other) != manifest_hash(implied)
    adamw_implied = _load(tmp_path, 'name = "adamw"')
    adamw_explicit = _load(tmp_path, 'name = "adamw"\nbetas = [0.9, 0.95]')
    assert manifest_hash(adamw_implied) == manifest_hash(adamw_explicit)
    assert adamw_implied.to_dict()["optim"]["betas"] == [0.9, 0.95]


def test_empty_betas_is_an_error_not_a_default(tmp_path):
    with pytest.raises(ManifestError, match=r"optim.betas: .*omit the field"):
        _load(tmp_path, 'name = "adamw"\nbetas = []')


def test_shipped_manifests_keep_adamw():
    for name in ("default", "test"):
        m = load_manifest(name)
        assert m.optim.name == "adamw" and m.optim.betas == (0.9, 0.95)
