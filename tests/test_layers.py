"""The package layout holds: imports point down only, inside ``node`` too (its rooms have an
order), no two modules of ``node`` import each other, and cross-package imports go through each
package's public face (its ``__init__``), which exports every name it lists."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import pytest

from tests.helpers.scripts import ROOT

PRODUCT = ("node", "protocol", "security", "stages")
FACES = ("stages", "security", "protocol", "node.base", "node.net", "node.ops", "node.runtime", "node.daemon")
_FROM = re.compile(r"^\s*from ((?:stages|security|protocol|node\.base|node\.net|node\.ops|node\.runtime))\.(\w+) "
                   r"import (\([^)]*\)|[^\n]+)", re.M)

# node's rooms, lowest first: a module may import its own room and the rooms below it, never one above.
# node/__init__.py (``lazy_face``) ranks with base; node/daemon.py or node/daemon/ is daemon, node/cli.py
# is cli, node/__main__.py is above everything.
ROOMS = ("base", "net", "runtime", "ops", "daemon", "cli", "__main__")


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


def test_the_command_line_help_loads_no_torch_or_hivemind():
    """``swarm-node --help`` imports every subcommand's module for its flags: none may load torch,
    hivemind or py-libp2p at import time (they load inside the commands)."""
    code = ("import sys; from node.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'hivemind', 'libp2p', 'trio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "COMMAND" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout[-300:] + out.stderr


def test_the_networking_face_loads_nothing_until_used():
    code = "import sys, node.base, node.net, node.ops; assert 'hivemind' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------- inside node/


def _module_name(path, root=ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """The room of a module of ``node`` (``node.net.p2p`` -> ``net``); ``node`` itself is base."""
    parts = module.split(".")
    return "base" if len(parts) == 1 else parts[1]


def _type_checking_only(tree) -> set:
    """The import nodes under ``if TYPE_CHECKING:`` (read by type checkers, never run)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            out.update(id(m) for stmt in n.body for m in ast.walk(stmt))
    return out


def _node_imports(path, root=ROOT, *, type_checking: bool = True):
    """``(line, module)`` for every import of a ``node`` module in ``path``: every import statement,
    those inside functions included, with ``from node import x`` naming ``node.x`` when ``x`` is a
    room or module, and the modules a face's ``_EXPORTS`` loads on first use. Without
    ``type_checking``, imports under ``if TYPE_CHECKING:`` are left out."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_checking else _type_checking_only(tree)
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            for alias in n.names:
                if alias.name == "node" or alias.name.startswith("node."):
                    yield n.lineno, alias.name
        elif isinstance(n, ast.ImportFrom):
            if n.level:  # relative: resolve against this module's package
                package = _module_name(path, root).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                base = ".".join(package[: len(package) - n.level + 1] + ([n.module] if n.module else []))
            else:
                base = n.module or ""
            if base != "node" and not base.startswith("node."):
                continue
            for alias in n.names:
                sub = f"{base}.{alias.name}"
                yield n.lineno, sub if _is_node_module(sub, root) else base
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in n.targets):
            for v in getattr(n.value, "values", []):
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith("node."):
                    yield v.lineno, v.value


def _is_node_module(name: str, root=ROOT) -> bool:
    rel = root.joinpath(*name.split("."))
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def _node_modules():
    for path in _sources("node"):
        yield path, _module_name(path)


def test_node_modules_import_their_own_room_or_a_lower_one():
    """``base`` < ``net`` < ``runtime`` < ``ops`` < ``daemon`` < ``cli`` (< ``__main__``): an import
    of a higher room, even one inside a function, is named with its file, line and both rooms."""
    hits = []
    for path, module in _node_modules():
        mine = _room(module)
        assert mine in ROOMS, f"{path.relative_to(ROOT)}: room {mine!r} has no place in ROOMS; give it one"
        for line, target in _node_imports(path):
            theirs = _room(target)
            assert theirs in ROOMS, f"{path.relative_to(ROOT)}:{line}: imports {target}, of no known room"
            if ROOMS.index(theirs) > ROOMS.index(mine):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {theirs} ({target})")
    assert sorted(set(hits)) == []


def test_no_two_node_modules_import_each_other():
    """No import cycle between modules of ``node``, through any chain and whether the imports run
    at load time or inside functions (a lazy import must not hide a cycle); an import for type
    hints only (``if TYPE_CHECKING:``) runs never and does not count."""
    graph = {module: {t for _, t in _node_imports(path, type_checking=False) if t != module}
             for path, module in _node_modules()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_import_reader_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """The checks above read every import statement: one inside a function, a relative one, and
    one for type hints only (which the cycle check leaves out)."""
    room = tmp_path / "node" / "net"
    room.mkdir(parents=True)
    (room / "x.py").write_text("def f():\n    from node.ops import train\n    from ..base import CliError\n"
                               "if TYPE_CHECKING:\n    from node.daemon import Node\n")
    found = sorted(_node_imports(room / "x.py", tmp_path))
    assert [(line, _room(t)) for line, t in found] == [(2, "ops"), (3, "base"), (5, "daemon")]
    assert sorted(_node_imports(room / "x.py", tmp_path, type_checking=False)) == found[:2]
