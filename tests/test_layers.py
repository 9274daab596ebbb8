"""The package layout holds: imports point down only, and cross-package imports go through each
package's public face (its ``__init__``), which exports every name it lists."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.helpers.scripts import ROOT

PRODUCT = ("node", "protocol", "security", "stages")
FACES = ("stages", "security", "protocol", "node.net", "node.ops", "node.runtime")
_FROM = re.compile(r"^\s*from ((?:stages|security|protocol|node\.net|node\.ops|node\.runtime))\.(\w+) import "
                   r"(\([^)]*\)|[^\n]+)", re.M)


def _package_of(path) -> str:
    parts = path.relative_to(ROOT).parts
    return "node." + parts[1] if parts[0] == "node" and len(parts) > 2 else parts[0]


def _sources(*tops):
    for top in tops:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_lower_layers_never_import_node_or_do_network_io():
    bad = re.compile(r"^\s*(from|import)\s+(node(\.|\s|$)|hivemind|libp2p|asyncio|socket|trio)", re.M)
    hits = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in _sources("stages", "protocol", "security")
            for m in bad.finditer(p.read_text())]
    assert hits == []


def test_cross_package_imports_go_through_the_public_face():
    """Code in the product and the scripts names another package's public names through that
    package's ``__init__``; only private names (``_x``) may be taken from a module."""
    hits = []
    for path in _sources(*PRODUCT, "scripts"):
        for m in _FROM.finditer(path.read_text()):
            if _package_of(path) == m.group(1):
                continue
            names = [n.split(" as ")[0].strip() for n in re.sub(r"#[^\n]*", "", m.group(3)).strip("()").split(",")]
            public = [n for n in names if n and not n.startswith("_")]
            if public:
                hits.append(f"{path.relative_to(ROOT)}: from {m.group(1)}.{m.group(2)} import {', '.join(public)}")
    assert hits == []


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves(face):
    module = importlib.import_module(face)
    assert module.__all__, face
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{face}.{name}"


def test_the_networking_face_loads_nothing_until_used():
    code = "import sys, node.net, node.ops; assert 'hivemind' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
