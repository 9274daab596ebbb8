"""Shared test fixtures. The asyncio loop is uvloop where available (pytest-asyncio strict mode)."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.scripts import ROOT


def pytest_asyncio_loop_factories(config, item):
    """Run every asyncio test on uvloop (the daemon's loop), plain asyncio where unavailable."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency on Linux
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def one_torch_thread():
    """Stages that share this process run with one intra-op thread each, so they do not fight
    over the cores (``pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def test_manifest():
    from stages import load_manifest

    return load_manifest(ROOT / "stages" / "runs" / "test.toml")


@pytest.fixture(scope="session")
def default_manifest():
    from stages import load_manifest

    return load_manifest(ROOT / "stages" / "runs" / "default.toml")
