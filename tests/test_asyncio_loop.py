import asyncio

import pytest
import uvloop


@pytest.mark.asyncio
async def test_tests_run_on_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
