import asyncio

import pytest


@pytest.mark.asyncio
async def test_tests_run_on_uvloop():
    uvloop = pytest.importorskip("uvloop")
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
