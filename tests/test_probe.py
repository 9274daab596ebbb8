"""Interoperability: py-libp2p (another libp2p implementation, in its own process) dials our
hivemind/go-libp2p node over Noise + yamux and speaks our frame protocol to it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import pytest

from node.net import Transport
from protocol import FWD, HEALTH, Expect, make_ack, make_health, validate_fwd, validate_health_request

RUN, MANIFEST = "swarm-test", "f" * 64


def test_probe_module_never_imports_hivemind():
    import subprocess

    code = "import sys, node.net.probe, node.net.probe_libp2p; assert 'hivemind' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_py_libp2p_probe_talks_to_our_node(capsys):
    from node.net import probe
    from tests.helpers.procs import assert_no_p2pd_left

    node = await Transport.start()
    seen = []
    try:
        expect = Expect.fwd(RUN, MANIFEST, 1, 8, max_batch=4, max_seq=32)

        async def health(frame, peer):
            validate_health_request(frame)
            return make_health({"peer": node.peer_id, "run": RUN, "stage": 1})

        async def fwd(frame, peer):
            seen.append(peer)
            f = validate_fwd(frame, expect, peer)
            return make_ack(f.mb, 1, 0)

        await node.serve(HEALTH, health)
        await node.serve(FWD, fwd)
        maddr = (await node.visible_maddrs())[0]

        # the CLI path: a child process runs py-libp2p; our loop keeps serving meanwhile
        parser = argparse.ArgumentParser()
        probe.add_arguments(parser)
        args = parser.parse_args([maddr, "--json", "--timeout", "20"])
        rc = await asyncio.to_thread(probe.main, args)
        r = json.loads(capsys.readouterr().out)
        assert rc == 0 and r["ok"], (r.get("error"), r)
        assert r["reachable"] and r["security"] == "/noise" and r["muxer"] == "/yamux/1.0.0"
        assert r["peer_id"] == node.peer_id and r["probe_peer_id"] != node.peer_id
        assert r["health"]["type"] == "health" and r["health"]["version"] == 1
        assert r["health"]["status"] == {"peer": node.peer_id, "run": RUN, "stage": 1}
        assert r["fwd"]["type"] == "reject" and r["fwd"]["reason"] == "wrong-run"
        assert r["fwd"]["run"] in r["fwd"]["detail"]
        assert r["health"]["rtt_ms"] > 0 and r["fwd"]["rtt_ms"] > 0
        assert seen == [r["probe_peer_id"]]  # the stream came from the py-libp2p peer

        # text output, with the run id given: the manifest hash is still wrong
        args = parser.parse_args([maddr, "--run", RUN, "--timeout", "20"])
        rc = await asyncio.to_thread(probe.main, args)
        text = capsys.readouterr().out
        assert rc == 0
        assert "reachable   yes" in text and "protocol version 1" in text
        assert "rejected with 'wrong-run'" in text and "manifest hash" in text and "result      ok" in text
    finally:
        await node.close()
    assert_no_p2pd_left()

    # the node is gone: the probe says so and exits 1
    r = await asyncio.to_thread(probe.run_probe, maddr, None, 3.0)
    assert not r["reachable"] and "connect" in r["error"] and not probe.ok(r)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_probe_retries_a_reset_stream_once_then_fails():
    """A node whose health handler drops every stream: the probe tries a second stream, says
    so in ``retried``, and still fails (a retry never hides a broken node)."""
    from node.net import probe
    from tests.helpers.procs import assert_no_p2pd_left

    node = await Transport.start()
    resets = []
    try:

        async def reset(info, reader, writer):
            resets.append(info.peer_id.to_base58())
            writer.transport.abort()  # p2pd resets the libp2p stream

        await node.p2p.add_binary_stream_handler(HEALTH, reset)
        maddr = (await node.visible_maddrs())[0]
        r = await asyncio.to_thread(probe.run_probe, maddr, None, 20.0)
    finally:
        await node.close()
    assert_no_p2pd_left()
    assert r["reachable"] and not probe.ok(r)
    # p2pd resets the libp2p stream when our side drops it; py-libp2p sees that as a stream that
    # ends before any reply or, when the reset arrives before it has finished negotiating the
    # stream's protocol, as one that fails to open: either way a reset, retried once, then a failure
    gone = {"health: NoReply: stream ended after 0 of 8 bytes",
            f"health: StreamFailure: failed to open a stream to peer {r['peer_id']}"}
    assert r["error"] in gone and len(r["retried"]) == 1 and r["retried"][0] in gone, r
    assert resets == [r["probe_peer_id"]] * 2
    assert f"retried     {r['retried'][0]} (once, on a new stream)" in probe.format_result(r)
