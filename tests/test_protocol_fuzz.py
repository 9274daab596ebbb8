"""Fuzz: >= 10,000 random and mutated frames through the decoder and the message validators.

Every input must either decode (and then validate or be refused with a reason code) or raise
``ProtocolError`` with a reason code; any other exception is a bug. Memory is traced: no input
may make the decoder allocate beyond what its limits allow, whatever lengths it claims.
"""

from __future__ import annotations

import math
import random
import struct
import tracemalloc

import msgpack
import pytest
import torch

from protocol import (
    MAGIC, OPTIONAL_FIELDS, REQUIRED_FIELDS, Expect, FrameDecoder, Limits, ProtocolError, Reason,
    StateAssembler, encode_frame_bytes, make_ack, make_bwd, make_fwd, make_health, make_health_request,
    make_reject, make_state_chunk, make_state_request, parse_health, parse_reply, state_chunks, validate_bwd,
    validate_fwd, validate_health_request, validate_state_request,
)

RUN, HASH, K, B, L = "fuzz-run", "ab" * 32, 8, 2, 16
LIMITS = Limits(max_header_bytes=4096, max_body_bytes=64 * 1024, max_tensors=16)
# Header objects expand in memory (a 1-byte msgpack "[]" becomes a ~56-byte list), so the bound
# is the body limit plus a generous per-header-byte factor plus fixed slack.
MEMORY_BOUND = LIMITS.max_body_bytes + 100 * LIMITS.max_header_bytes + 128 * 1024
N_CASES = 10_000

STATE = {"w": torch.randn(40, 20), "b": torch.randn(20), "n": torch.randn(3).to(torch.bfloat16)}


def corpus() -> list[bytes]:
    j = b"".join
    g = torch.Generator().manual_seed(0)
    c = torch.randn(B, L, K, generator=g)
    ids = torch.randint(0, 256, (B, L), generator=g)
    frames = [
        j(make_fwd(RUN, HASH, 5, 0, 10, ["p0"], c, ids, sent_ms=1)),
        j(make_fwd(RUN, HASH, 6, 0, 10, ["p0"], c.to(torch.bfloat16), ids.int(), sent_ms=2)),
        j(make_bwd(RUN, HASH, 5, 2, 10, ["p0", "p1", "p2"], c, sent_ms=3)),
        j(make_bwd(RUN, HASH, 5, 2, 10, ["p0", "p1", "p2"], None, skip="rejected-by-verifier", detail="x")),
        j(make_bwd(RUN, HASH, 5, 2, 10, ["p0", "p1", "p2"], None, skip="rejected-by-verifier", detail="x",
                   score=1.25, refused="own")),
        j(make_ack(5, 1, 10, queue=3)),
        j(make_reject(Reason.BUSY, "queue full", mb=5, retry_ms=100)),
        j(make_reject(Reason.REJECTED_BY_VERIFIER, "sentinel:swd", mb=5, score=1.5)),
        j(make_health_request()),
        j(make_health({"peer": "p1", "stage": 1, "version": 10, "run": RUN})),
        j(make_state_request(RUN, HASH, 1, max_chunk_bytes=1024)),
        j(make_state_chunk(RUN, HASH, 1, 10, 0, True, list(STATE.items()))),
        encode_frame_bytes({"type": "fwd"}, [("a", torch.zeros(0, 3)), ("b", torch.ones(2, dtype=torch.bool))]),
    ]
    # A multi-chunk transfer: chunks after the first are only valid in sequence (seq > 0).
    frames += [j(b) for b in state_chunks(RUN, HASH, 1, 10, STATE, max_chunk_bytes=1024)]
    return frames


N_STANDALONE = 12  # corpus()[:N_STANDALONE] each validate on their own
# every header field a message type has (op 4 of mutate_header sets one of them to a random value)
FIELDS = sorted(set().union(*REQUIRED_FIELDS.values(), *OPTIONAL_FIELDS.values()))


def random_value(rng: random.Random):
    return rng.choice([
        None, True, False, -1, 0, 1, 7, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1, -(2**63),
        1.5, math.nan, math.inf, "", "x", "fwd", "bad-frame", "float32", "bfloat16", "int64", "p0", RUN, HASH,
        b"\x00\x01", [], [1], [2**40], [-1], [0, 0], [B, L, K], {}, {"name": "c"}, "a" * 300,
        [{"name": "c", "dtype": "float32", "shape": [2**20, 2**20]}],
    ])


def mutate_header(data: bytes, rng: random.Random) -> bytes:
    """Decode the header, damage one field or the tensor table, re-encode around the old body."""
    (hlen,) = struct.unpack(">I", data[4:8])
    try:
        header = msgpack.unpackb(data[8 : 8 + hlen], strict_map_key=False)
    except Exception:
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        return data[: rng.randrange(len(data))]  # already damaged: truncate instead
    body = data[8 + hlen :]
    op = rng.randrange(6)
    if op == 0 and header:
        header[rng.choice(list(header))] = random_value(rng)
    elif op == 1 and header:
        del header[rng.choice(list(header))]
    elif op == 2 and header.get("tensors") and isinstance(header["tensors"][0], dict):
        row = header["tensors"][rng.randrange(len(header["tensors"]))] if all(
            isinstance(r, dict) for r in header["tensors"]) else header["tensors"][0]
        row[rng.choice(["name", "dtype", "shape"])] = random_value(rng)
    elif op == 3 and header.get("tensors") and all(isinstance(r, dict) for r in header["tensors"]):
        row = rng.choice(header["tensors"])
        if isinstance(row.get("shape"), list) and row["shape"]:
            row["shape"][rng.randrange(len(row["shape"]))] = rng.choice([0, 1, 3, 2**16, 2**31, 2**62])
        header["body_len"] = rng.choice([header.get("body_len", 0), 2**30, len(body) + 1])
    elif op == 4:
        header[rng.choice(FIELDS)] = random_value(rng)
    else:
        header["body_len"] = random_value(rng)
    head = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack(">I", len(head)) + head + body


def mutate(data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    op = rng.randrange(12)
    if op == 0:  # bit flips
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # overwrite bytes, biased to the prefix and header
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(min(len(b), 64))] = rng.randrange(256)
    elif op == 2:  # insert
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 3:  # delete a range
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 32)]
    elif op == 4:  # truncate
        del b[rng.randrange(len(b)) :]
    elif op == 5:  # splice two frames
        other = rng.choice(pool)
        b = b[: rng.randrange(len(b))] + other[rng.randrange(len(other)) :]
    elif op == 6:  # lie about the header length
        b[4:8] = struct.pack(">I", rng.choice([0, 1, 7, 4096, 4097, 65536, 2**31, 2**32 - 1, rng.randrange(2**32)]))
    elif op in (7, 8, 9, 10):
        return mutate_header(data, rng)
    else:  # random bytes, with or without the magic
        return (MAGIC if rng.random() < 0.5 else b"") + rng.randbytes(rng.randint(0, 200))
    return bytes(b)


def exercise(frame) -> str:
    """Run the message layer on a decoded frame; return 'ok' or the reason code."""
    t = frame.type
    try:
        if t == "fwd":
            validate_fwd(frame, Expect.fwd(RUN, HASH, 1, K, B, L, max_version_lag=100, version=10), sender="p0")
        elif t == "bwd":
            validate_bwd(frame, Expect.bwd(RUN, HASH, 1, K, B, L, self_peer="p1"), sender="p2")
        elif t in ("ack", "reject"):
            parse_reply(frame)
        elif t == "health":
            parse_health(frame)
        elif t == "health-request":
            validate_health_request(frame)
        elif t == "state-request":
            validate_state_request(frame, RUN, HASH, 1)
        elif t == "state-chunk":
            StateAssembler(RUN, HASH, 1, STATE).add(frame)
        return "ok"
    except ProtocolError as e:
        assert isinstance(e.reason, Reason)
        return e.reason.value


def check_frame(frame):
    assert frame.nbytes <= LIMITS.max_body_bytes
    assert sum(t.numel() * t.element_size() for t in frame.tensors.values()) == frame.nbytes
    assert all(str(t.dtype).removeprefix("torch.") in LIMITS.dtypes for t in frame.tensors.values())


@pytest.mark.timeout(120)
def test_fuzz_decoder_and_validators():
    rng = random.Random(20240601)
    pool = corpus()
    outcomes: dict[str, int] = {}
    worst = 0
    tracemalloc.start()
    try:
        for case in range(N_CASES):
            base = rng.choice(pool)
            data = base if case % 20 == 0 else mutate(base, rng, pool)
            if rng.random() < 0.15:  # mutate twice sometimes
                data = mutate(data, rng, pool) if data[:4] == MAGIC and len(data) > 8 else data
            dec = FrameDecoder(LIMITS)
            cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randint(0, 6)))
            points = [0, *cuts, len(data)]
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            try:
                frames = []
                for a, b in zip(points, points[1:]):
                    frames += dec.feed(data[a:b])
                    assert dec.buffered_bytes <= LIMITS.max_header_bytes + LIMITS.max_body_bytes
                dec.eof()
                if not frames:
                    assert data == b"", "non-empty input produced neither a frame nor an error"
                    outcomes["empty"] = outcomes.get("empty", 0) + 1
                for frame in frames:
                    check_frame(frame)
                    r = exercise(frame)
                    outcomes[r] = outcomes.get(r, 0) + 1
                if data == base and pool.index(base) < N_STANDALONE:
                    assert len(frames) == 1 and exercise(frames[0]) == "ok", frames[0].header
            except ProtocolError as e:
                assert isinstance(e.reason, Reason)
                outcomes["decoder:" + e.reason.value] = outcomes.get("decoder:" + e.reason.value, 0) + 1
            except Exception as e:  # pragma: no cover - this is the failure the fuzz test hunts
                raise AssertionError(f"case {case}: {type(e).__name__}: {e}; input {data[:200].hex()}") from e
            peak = tracemalloc.get_traced_memory()[1] - before
            worst = max(worst, peak)
            assert peak <= MEMORY_BOUND, f"case {case}: peak {peak} bytes > {MEMORY_BOUND}"
    finally:
        tracemalloc.stop()
    total = sum(outcomes.values())
    assert total >= N_CASES  # every case ended in frames or an error
    # The corpus and mutations reach both the decoder's refusals and the message layer's.
    assert outcomes.get("ok", 0) > 500
    for reason in ("decoder:bad-frame", "decoder:too-large", "bad-frame", "wrong-run", "wrong-stage"):
        assert outcomes.get(reason, 0) > 0, (reason, outcomes)
    print(f"fuzz outcomes {dict(sorted(outcomes.items()))}, worst traced peak {worst} bytes")


def test_huge_claimed_lengths_allocate_nothing():
    def frame(header: dict, pad_to: int = 0) -> bytes:
        head = msgpack.packb(header).ljust(pad_to, b"\xc0")  # trailing nils: extra data, never read
        return MAGIC + struct.pack(">I", len(head)) + head

    claims = [
        MAGIC + struct.pack(">I", 2**32 - 1),
        MAGIC + struct.pack(">I", LIMITS.max_header_bytes + 1),
        frame({"v": 1, "type": "fwd", "tensors": [{"name": "c", "dtype": "float64", "shape": [2**31, 2**31]}],
               "body_len": 2**64 - 1}),
        frame({"v": 1, "type": "fwd", "tensors": [{"name": "c", "dtype": "uint8", "shape": [2**30]}],
               "body_len": 2**30}),
        frame({"v": 1, "type": "fwd", "tensors": [{"name": f"t{i}", "dtype": "uint8", "shape": [1]}
                                                  for i in range(LIMITS.max_tensors + 1)],
               "body_len": LIMITS.max_tensors + 1}),
    ]
    tracemalloc.start()
    try:
        for data in claims:
            dec = FrameDecoder(LIMITS)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            with pytest.raises(ProtocolError) as info:
                dec.feed(data)
                dec.eof()
            assert info.value.reason in (Reason.TOO_LARGE, Reason.BAD_FRAME)
            assert tracemalloc.get_traced_memory()[1] - before < 64 * 1024
    finally:
        tracemalloc.stop()


def test_long_stream_does_not_leak():
    """Thousands of frames through one decoder: memory returns to where it started."""
    data = b"".join(corpus()) * 20
    dec = FrameDecoder(LIMITS)
    tracemalloc.start()
    try:
        for _ in range(3):  # warm-up rounds populate caches (msgpack, torch dtype objects)
            for i in range(0, len(data), 4096):
                dec.feed(data[i : i + 4096])
        base = tracemalloc.get_traced_memory()[0]
        n = 0
        for _ in range(5):
            for i in range(0, len(data), 4096):
                n += len(dec.feed(data[i : i + 4096]))
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert n == 5 * 20 * len(corpus()) and dec.at_boundary
    assert grown < 64 * 1024, grown
