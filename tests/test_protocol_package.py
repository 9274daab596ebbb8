"""protocol/ is the one definition of the stream protocol ids and the version: its public face
(``protocol/__init__.py``) re-exports the frame and message API, and node/ uses its names."""

from __future__ import annotations

import subprocess
import sys

import protocol
from protocol import frames, messages, state_transfer


def test_all_names_exist_and_are_the_submodules_objects():
    assert len(protocol.__all__) == len(set(protocol.__all__))
    for name in protocol.__all__:
        obj = getattr(protocol, name)
        origin = [m for m in (frames, messages, state_transfer) if name in vars(m)]
        assert origin and all(getattr(m, name) is obj for m in origin), name
    used = {  # names other packages import from protocol.frames / .messages / .state_transfer
        "PROTOCOL_VERSION", "MAGIC", "PREFIX_LEN", "Frame", "FrameDecoder", "Limits", "ProtocolError", "Reason",
        "encode_frame", "encode_frame_bytes", "parse_header", "parse_prefix", "tensor_bytes",
        "FWD", "BWD", "STATE", "HEALTH", "PROTOCOLS", "EXCHANGES", "REQUIRED_FIELDS", "OPTIONAL_FIELDS",
        "Expect", "Reply", "Fwd", "Bwd", "StateAssembler", "make_fwd", "make_bwd", "make_ack", "make_reject",
        "make_reject_for", "make_health", "make_health_request", "make_state_request", "make_state_chunk",
        "state_chunks", "parse_reply", "parse_health", "validate_fwd", "validate_bwd", "validate_health_request",
        "validate_state_request", "check_request", "check_finite",
    }
    assert used <= set(protocol.__all__), used - set(protocol.__all__)


def test_protocol_ids_have_one_definition():
    from node.net import p2p, probe_libp2p
    from node.ops.metrics import _WireBytes

    v = protocol.PROTOCOL_VERSION
    assert protocol.PROTOCOLS == (f"/swarm-node/fwd/{v}", f"/swarm-node/bwd/{v}", f"/swarm-node/state/{v}",
                                  f"/swarm-node/health/{v}", f"/swarm-node/morph/{v}")
    assert not any(hasattr(p2p, name) for name in ("FWD", "BWD", "STATE", "HEALTH", "PROTOCOLS"))  # no copies
    assert probe_libp2p.FWD is protocol.FWD and probe_libp2p.HEALTH is protocol.HEALTH
    assert probe_libp2p.VERSION == v and probe_libp2p.MAGIC == b"SWN1"  # the magic is from the spec, on purpose
    assert _WireBytes.NAMES == {protocol.FWD: "fwd", protocol.BWD: "bwd", protocol.STATE: "state",
                                protocol.HEALTH: "health", protocol.MORPH: "morph"}
    assert not hasattr(messages, "FWD_PROTOCOL")


def test_protocol_imports_neither_hivemind_nor_other_layers():
    code = ("import sys, protocol; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('hivemind', 'libp2p', 'node', 'security', 'stages')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", (out.stdout, out.stderr)
