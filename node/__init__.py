"""swarm-node's daemon: the only package with I/O. Its rooms, lowest first: ``base/`` (errors,
checkpoint format, processes, logging), ``net/`` (networking), ``runtime/`` (the stage runtime),
``ops/`` (operations), ``daemon/`` (one node wired together) and ``cli.py`` (the command line). A
module imports its own room and the rooms below it, never one above (``tests/test_layers.py``);
this file (``lazy_face``) ranks with ``base``. It may use ``protocol``, ``security`` and
``stages`` through their public faces; they never use it."""

import importlib


def lazy_face(package: str, exports: dict[str, str], namespace: dict):
    """A module ``__getattr__`` for the public face of ``package``: each exported name is imported
    from its module (``exports``: name -> module) on first use and kept in ``namespace``, so
    importing the face loads nothing heavy until a name that needs it is used."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    return __getattr__
