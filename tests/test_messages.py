"""Messages: builders <-> validators, every refusal with its reason code, state transfer, and the
agreement of docs/PROTOCOL.md with the code (tables parsed out of the document)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import msgpack
import pytest
import torch

from protocol import (
    BWD, EXCHANGES, FWD, HEALTH, MAGIC, MAX_DETAIL, MAX_ID_LEN, MAX_ROUTE, MORPH, OPTIONAL_FIELDS, PROTOCOLS,
    MORPH_SEED_BYTES, REQUIRED_FIELDS, SKIP_ONLY_FIELDS, STATE, Expect, FrameDecoder, ProtocolError, Reason, Refused,
    StateAssembler, check_finite, check_request, encode_frame_bytes, frames, make_ack, make_bwd, make_fwd,
    make_health, make_health_request, make_reject, make_reject_for, make_state_chunk, make_state_request,
    make_morph_seed, parse_health, parse_reply, state_chunks, validate_bwd, validate_fwd, validate_health_request,
    validate_morph_seed, validate_state_request,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md"
RUN, HASH, K = "run-x", "f00d" * 16, 8
ROUTE = ["peerA", "peerB", "peerC"]


def dec(buffers) -> frames.Frame:
    out = FrameDecoder().feed(b"".join(buffers))
    assert len(out) == 1
    return out[0]


def fwd(c=None, ids=None, **kw):
    g = torch.Generator().manual_seed(0)
    c = torch.randn(2, 5, K, generator=g) if c is None else c
    ids = torch.randint(0, 256, (2, 5), generator=g) if ids is None else ids
    args = dict(run=RUN, manifest_hash=HASH, mb=11, stage=1, version=20, route=ROUTE[:2], sent_ms=5)
    args.update(kw)
    return dec(make_fwd(c=c, ids=ids, **args))


def bwd(grad="default", **kw):
    grad = torch.randn(2, 5, K) if isinstance(grad, str) else grad
    args = dict(run=RUN, manifest_hash=HASH, mb=11, stage=2, version=20, route=ROUTE, sent_ms=5)
    args.update(kw)
    return dec(make_bwd(grad=grad, **args))


def expect_fwd(**kw):
    return Expect.fwd(RUN, HASH, 2, K, max_batch=4, max_seq=16, **kw)


def expect_bwd(**kw):
    return Expect.bwd(RUN, HASH, 1, K, max_batch=4, max_seq=16, **kw)


def reason_of(fn, *args, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)
    return info.value


# ---------------------------------------------------------------------------------------------
# fwd / bwd


def test_fwd_round_trip_and_zero_copy_alignment():
    c = torch.randn(3, 7, K).to(torch.bfloat16)
    ids = torch.randint(0, 256, (3, 7))
    frame = fwd(c=c, ids=ids)
    assert [t["name"] for t in frame.header["tensors"]] == ["ids", "c"]  # widest first: aligned
    msg = validate_fwd(frame, expect_fwd(version=22, max_version_lag=2), sender="peerB")
    assert (msg.mb, msg.stage, msg.version, msg.route, msg.codec, msg.sent_ms) == (11, 1, 20, ("peerA", "peerB"),
                                                                                  "subspace", 5)
    assert torch.equal(msg.c, c) and torch.equal(msg.ids, ids)
    assert msg.c.data_ptr() == msg.ids.data_ptr() + ids.numel() * 8  # both views of one body


def test_fwd_optional_horizon():
    assert validate_fwd(fwd(), expect_fwd(), sender="peerB").horizon_s is None
    assert validate_fwd(fwd(horizon_s=4.25), expect_fwd(), sender="peerB").horizon_s == 4.25
    assert validate_fwd(fwd(horizon_s=3), expect_fwd(), sender="peerB").horizon_s == 3.0


def test_bwd_round_trip_and_skip():
    g = torch.randn(1, 16, K)
    msg = validate_bwd(bwd(grad=g), expect_bwd(self_peer="peerB"), sender="peerC")
    assert torch.equal(msg.grad, g) and msg.skip is None and msg.route == tuple(ROUTE)
    skip = bwd(grad=None, skip=Reason.REJECTED_BY_VERIFIER, detail="cosine check failed")
    assert skip.tensors == {} and skip.header["skip"] == "rejected-by-verifier"
    msg = validate_bwd(skip, expect_bwd())
    assert msg.grad is None and msg.skip == "rejected-by-verifier" and msg.detail == "cosine check failed"
    future = FrameDecoder().feed(encode_frame_bytes(dict(
        type="bwd", run=RUN, manifest=HASH, mb=1, stage=2, version=0, route=ROUTE, codec="s", sent_ms=0,
        skip="quarantined")))[0]
    assert validate_bwd(future, expect_bwd()).skip == "internal" and future.header["skip"] == "quarantined"
    with pytest.raises(ValueError):
        make_bwd(RUN, HASH, 1, 2, 0, ROUTE, torch.zeros(1, 1, K), skip="stale")
    with pytest.raises(ValueError):
        make_bwd(RUN, HASH, 1, 2, 0, ROUTE, None)


def skip_frame(**kw):
    """A bwd skip as a peer may send it, raw (the builder refuses what a validator must catch)."""
    header = dict(type="bwd", run=RUN, manifest=HASH, mb=1, stage=2, version=0, route=ROUTE, codec="s",
                  sent_ms=0, skip="rejected-by-verifier", detail="d")
    header.update(kw)
    header = {k: v for k, v in header.items() if v is not None}
    return FrameDecoder().feed(encode_frame_bytes(header))[0]


def test_bwd_skip_score_and_refused_round_trip():
    frame = bwd(grad=None, skip=Reason.REJECTED_BY_VERIFIER, detail="sentinel:swd", score=1.25,
                refused=Refused.OWN)
    assert frame.header["score"] == 1.25 and isinstance(frame.header["score"], float)
    assert frame.header["refused"] == "own"
    msg = validate_bwd(frame, expect_bwd())
    assert (msg.skip, msg.detail, msg.score, msg.refused) == ("rejected-by-verifier", "sentinel:swd", 1.25, "own")
    relayed = validate_bwd(bwd(grad=None, skip="rejected-by-verifier", score=3, refused="relayed"), expect_bwd())
    assert (relayed.score, relayed.refused) == (3.0, "relayed") and isinstance(relayed.score, float)
    plain = validate_bwd(bwd(grad=None, skip="stale"), expect_bwd())  # both optional
    assert (plain.score, plain.refused) == (None, None)
    assert "score" not in plain.header and "refused" not in plain.header
    grad = validate_bwd(bwd(), expect_bwd())
    assert (grad.score, grad.refused) == (None, None)
    # a newer peer's value of refused: no attribution, like an unknown reason code (kept for logs)
    future = validate_bwd(skip_frame(refused="downstream-of-downstream", score=2.0), expect_bwd())
    assert future.refused is None and future.header["refused"] == "downstream-of-downstream"
    assert future.score == 2.0 and future.skip == "rejected-by-verifier"
    assert validate_bwd(skip_frame(score=None, refused=None), expect_bwd()).refused is None
    assert set(SKIP_ONLY_FIELDS) <= set(OPTIONAL_FIELDS["bwd"])


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(score="high"), "field 'score' is 'high' (str); need a number"),
        (dict(score=True), "field 'score' is True (bool); need a number"),
        (dict(score=[1.5]), "field 'score' is [1.5] (list); need a number"),
        (dict(score=float("nan")), "field 'score' is nan; need a finite number"),
        (dict(score=float("inf")), "field 'score' is inf; need a finite number"),
        (dict(score=float("-inf")), "field 'score' is -inf; need a finite number"),
        (dict(score=-1.5), "field 'score' is -1.5; need a number > 0"),
        (dict(score=0), "field 'score' is 0; need a number > 0"),
        (dict(score=0.0), "field 'score' is 0.0; need a number > 0"),
        (dict(refused=1), "bwd field 'refused' is 1; need a non-empty str <= 64"),
        (dict(refused=""), "bwd field 'refused' is ''; need a non-empty str <= 64"),
        (dict(refused="x" * 65), "bwd field 'refused' is"),
        (dict(refused=["own"]), "bwd field 'refused' is ['own']"),
    ],
)
def test_bwd_skip_malformed_score_and_refused(kw, needle):
    err = reason_of(validate_bwd, skip_frame(**kw), expect_bwd())
    assert err.reason is Reason.BAD_FRAME and needle in err.detail, err.detail
    assert err.detail.startswith("bwd field"), err.detail


@pytest.mark.parametrize("kw", [dict(score=1.5), dict(refused="own"), dict(score=2.0, refused="relayed"),
                                dict(refused="not-a-value")])
def test_gradient_bwd_never_carries_score_or_refused(kw):
    base = dict(type="bwd", run=RUN, manifest=HASH, mb=1, stage=2, version=0, route=ROUTE, codec="s", sent_ms=0)
    frame = FrameDecoder().feed(encode_frame_bytes({**base, **kw}, [("grad", torch.zeros(1, 1, K))]))[0]
    err = reason_of(validate_bwd, frame, expect_bwd())
    assert err.reason is Reason.BAD_FRAME
    assert f"bwd field(s) {sorted(kw, key=SKIP_ONLY_FIELDS.index)} go with 'skip' only" in err.detail, err.detail


def test_make_bwd_score_and_refused_arguments():
    g = torch.zeros(1, 1, K)
    with pytest.raises(ValueError, match="skip= only"):
        make_bwd(RUN, HASH, 1, 2, 0, ROUTE, g, score=1.5)
    with pytest.raises(ValueError, match="skip= only"):
        make_bwd(RUN, HASH, 1, 2, 0, ROUTE, g, refused="own")
    with pytest.raises(ValueError):
        make_bwd(RUN, HASH, 1, 2, 0, ROUTE, None, skip="stale", refused="mine")  # a builder sends known values
    for bad in (float("nan"), float("inf"), 0.0, -2.0, True, "1.5"):
        with pytest.raises(ValueError, match="score must be a finite number > 0"):
            make_bwd(RUN, HASH, 1, 2, 0, ROUTE, None, skip="stale", score=bad)


@pytest.mark.parametrize(
    "frame_kw, expect_kw, sender, reason, needle",
    [
        (dict(run="other"), {}, None, Reason.WRONG_RUN, "run"),
        (dict(manifest_hash="beef"), {}, None, Reason.WRONG_RUN, "manifest"),
        (dict(stage=0, route=["peerA"]), {}, None, Reason.WRONG_STAGE, "stage 0"),
        (dict(version=3), dict(version=10, max_version_lag=6), None, Reason.STALE, "lag 7 > 6"),
        (dict(codec="raw"), dict(codec="subspace"), None, Reason.BAD_FRAME, "codec"),
        (dict(route=["peerA"]), {}, None, Reason.BAD_FRAME, "route"),
        ({}, {}, "mallory", Reason.BAD_FRAME, "mallory"),
        (dict(mb=-1), {}, None, Reason.BAD_FRAME, "'mb'"),
        (dict(mb=True), {}, None, Reason.BAD_FRAME, "'mb'"),
        (dict(version=-5), {}, None, Reason.BAD_FRAME, "'version'"),
        (dict(route=["p"] * (MAX_ROUTE + 1)), {}, None, Reason.BAD_FRAME, "'route'"),
        (dict(route=["peerA", "x" * (MAX_ID_LEN + 1)]), {}, None, Reason.BAD_FRAME, "'route'"),
        (dict(codec=""), {}, None, Reason.BAD_FRAME, "'codec'"),
        (dict(sent_ms="now"), {}, None, Reason.BAD_FRAME, "'sent_ms'"),
        (dict(c=torch.randn(2, 5, K + 1)), {}, None, Reason.BAD_FRAME, "'c'"),
        (dict(c=torch.randn(2, 5, K).double()), {}, None, Reason.BAD_FRAME, "float64"),
        (dict(ids=torch.zeros(2, 5, dtype=torch.int16)), {}, None, Reason.BAD_FRAME, "int16"),
        (dict(c=torch.randn(5, 5, K), ids=torch.zeros(5, 5, dtype=torch.long)), {}, None, Reason.TOO_LARGE, "B=5"),
        (dict(c=torch.randn(2, 17, K), ids=torch.zeros(2, 17, dtype=torch.long)), {}, None, Reason.TOO_LARGE,
         "L=17"),
        (dict(ids=torch.zeros(2, 4, dtype=torch.long)), {}, None, Reason.BAD_FRAME, "disagrees"),
        (dict(c=torch.randn(0, 5, K), ids=torch.zeros(0, 5, dtype=torch.long)), {}, None, Reason.BAD_FRAME,
         ">= 1"),
        (dict(c=torch.full((2, 5, K), float("nan"))), {}, None, Reason.BAD_FRAME, "non-finite"),
        (dict(horizon_s="far"), {}, None, Reason.BAD_FRAME, "'horizon_s'"),
        (dict(horizon_s=-1.0), {}, None, Reason.BAD_FRAME, "'horizon_s'"),
        (dict(horizon_s=float("inf")), {}, None, Reason.BAD_FRAME, "'horizon_s'"),
        (dict(horizon_s=1e9), {}, None, Reason.BAD_FRAME, "'horizon_s'"),
        (dict(horizon_s=True), {}, None, Reason.BAD_FRAME, "'horizon_s'"),
    ],
)
def test_fwd_refusals(frame_kw, expect_kw, sender, reason, needle):
    frame = fwd(**frame_kw)
    err = reason_of(validate_fwd, frame, expect_fwd(**expect_kw), sender=sender)
    assert err.reason is reason and needle in err.detail, err.detail


def test_fwd_tensor_set_must_be_exact():
    base = dict(type="fwd", run=RUN, manifest=HASH, mb=1, stage=1, version=0, route=ROUTE[:2], codec="s",
                sent_ms=0)
    c, ids = torch.zeros(1, 2, K), torch.zeros(1, 2, dtype=torch.long)
    missing = FrameDecoder().feed(encode_frame_bytes(base, [("c", c)]))[0]
    assert "missing ['ids']" in reason_of(validate_fwd, missing, expect_fwd()).detail
    extra = FrameDecoder().feed(encode_frame_bytes(base, [("c", c), ("ids", ids), ("x", c)]))[0]
    assert "unexpected ['x']" in reason_of(validate_fwd, extra, expect_fwd()).detail
    wrong_type = fwd()
    wrong_type.header["type"] = "bwd"
    assert reason_of(validate_fwd, wrong_type, expect_fwd()).reason is Reason.BAD_FRAME


def test_bwd_refusals():
    assert reason_of(validate_bwd, bwd(stage=1), expect_bwd()).reason is Reason.WRONG_STAGE
    assert reason_of(validate_bwd, bwd(route=ROUTE[:2]), expect_bwd()).reason is Reason.BAD_FRAME
    err = reason_of(validate_bwd, bwd(), expect_bwd(self_peer="peerZ"))
    assert "not on the microbatch's route" in err.detail
    assert "came from" in reason_of(validate_bwd, bwd(), expect_bwd(), sender="peerB").detail
    inf = torch.zeros(1, 1, K)
    inf[0, 0, 3] = float("inf")
    assert "non-finite" in reason_of(validate_bwd, bwd(grad=inf), expect_bwd()).detail
    base = dict(type="bwd", run=RUN, manifest=HASH, mb=1, stage=2, version=0, route=ROUTE, codec="s",
                sent_ms=0, skip="stale")
    skip_with_tensor = FrameDecoder().feed(encode_frame_bytes(base, [("grad", torch.zeros(1, 1, K))]))[0]
    assert "no tensors" in reason_of(validate_bwd, skip_with_tensor, expect_bwd()).detail


def test_check_finite_only_looks_at_floats():
    check_finite({"ids": torch.tensor([2**62]), "b": torch.tensor([True]), "e": torch.empty(0)})
    with pytest.raises(ProtocolError):
        check_finite({"h": torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)})


def test_expect_max_body_bytes_is_a_tight_decoder_limit():
    e = expect_fwd()
    assert e.max_body_bytes() == 4 * 16 * K * 4 + 4 * 16 * 8
    limits = frames.Limits(max_body_bytes=e.max_body_bytes())
    biggest = make_fwd(RUN, HASH, 1, 1, 0, ROUTE[:2], torch.zeros(4, 16, K), torch.zeros(4, 16, dtype=torch.long))
    frame = FrameDecoder(limits).feed(b"".join(biggest))[0]
    validate_fwd(frame, e)
    over = make_fwd(RUN, HASH, 1, 1, 0, ROUTE[:2], torch.zeros(4, 17, K), torch.zeros(4, 16, dtype=torch.long))
    assert reason_of(FrameDecoder(limits).feed, b"".join(over)).reason is Reason.TOO_LARGE
    assert Expect.bwd(RUN, HASH, 1, K, 4, 16).max_body_bytes() == 4 * 16 * K * 4


def test_expect_constructors():
    with pytest.raises(ValueError):
        Expect.fwd(RUN, HASH, 0, K, 4, 16)
    e = Expect.bwd(RUN, HASH, 3, K, 4, 16)
    assert e.stage == 4 and set(e.tensors) == {"grad"}


# ---------------------------------------------------------------------------------------------
# Replies, health, protocol ids


def test_ack_and_reject_replies():
    ack = parse_reply(dec(make_ack(11, stage=2, version=30, queue=4)))
    assert (ack.ok, ack.mb, ack.stage, ack.version, ack.queue) == (True, 11, 2, 30, 4)
    rej = parse_reply(dec(make_reject(Reason.BUSY, "queue full", mb=11, retry_ms=250)))
    assert (rej.ok, rej.reason, rej.reason_code, rej.detail, rej.retry_ms) == (False, Reason.BUSY, "busy",
                                                                             "queue full", 250)
    long = parse_reply(dec(make_reject("internal", "x" * 5000)))
    assert len(long.detail) == MAX_DETAIL
    err = ProtocolError(Reason.STALE, "too old")
    assert parse_reply(dec(make_reject_for(err, mb=3))).reason is Reason.STALE
    with pytest.raises(ValueError):
        make_reject("not-a-code", "x")


def test_reject_score_round_trip():
    rej = parse_reply(dec(make_reject(Reason.REJECTED_BY_VERIFIER, "sentinel:swd", mb=4, score=1.094)))
    assert (rej.reason, rej.detail, rej.mb, rej.score) == (Reason.REJECTED_BY_VERIFIER, "sentinel:swd", 4, 1.094)
    assert isinstance(dec(make_reject("rejected-by-verifier", "x", score=2)).header["score"], float)
    assert parse_reply(dec(make_reject(Reason.BUSY, "full"))).score is None
    assert parse_reply(dec(make_ack(1, 1, 1))).score is None
    for bad in (float("nan"), float("-inf"), 0, -1.0, False, "2"):
        with pytest.raises(ValueError, match="make_reject: score must be a finite number > 0"):
            make_reject(Reason.REJECTED_BY_VERIFIER, "x", score=bad)


@pytest.mark.parametrize(
    "score, needle",
    [
        ("1.5", "reject field 'score' is '1.5' (str); need a number"),
        (False, "reject field 'score' is False (bool); need a number"),
        ({"v": 1}, "reject field 'score' is {'v': 1} (dict); need a number"),
        (float("nan"), "reject field 'score' is nan; need a finite number"),
        (float("inf"), "reject field 'score' is inf; need a finite number"),
        (-0.5, "reject field 'score' is -0.5; need a number > 0"),
        (0, "reject field 'score' is 0; need a number > 0"),
    ],
)
def test_reject_malformed_score(score, needle):
    frame = dec([encode_frame_bytes({"type": "reject", "reason": "rejected-by-verifier", "detail": "x",
                                     "score": score})])
    err = reason_of(parse_reply, frame)
    assert err.reason is Reason.BAD_FRAME and needle in err.detail, err.detail


def test_unknown_reason_code_maps_to_internal():
    frame = dec([encode_frame_bytes({"type": "reject", "reason": "overheated", "detail": "gpu at 95C"})])
    reply = parse_reply(frame)
    assert reply.reason is Reason.INTERNAL and reply.reason_code == "overheated"


def test_reply_refusals():
    no_mb = FrameDecoder().feed(encode_frame_bytes({"type": "ack", "stage": 1, "version": 2}))[0]
    assert "'mb'" in reason_of(parse_reply, no_mb).detail
    no_detail = FrameDecoder().feed(encode_frame_bytes({"type": "reject", "reason": "busy"}))[0]
    assert reason_of(parse_reply, no_detail).reason is Reason.BAD_FRAME
    with_tensor = FrameDecoder().feed(encode_frame_bytes(
        {"type": "ack", "mb": 1, "stage": 1, "version": 2}, [("x", torch.zeros(1))]))[0]
    assert "no tensors" in reason_of(parse_reply, with_tensor).detail
    assert reason_of(parse_reply, fwd()).reason is Reason.BAD_FRAME


def test_health():
    validate_health_request(dec(make_health_request()))
    status = parse_health(dec(make_health({"peer": "peerB", "stage": 1, "ready": True})))
    assert status == {"peer": "peerB", "stage": 1, "ready": True, "v": 1}
    with pytest.raises(ValueError):
        make_health({1: "x"})
    bad = FrameDecoder().feed(encode_frame_bytes({"type": "health", "status": [1]}))[0]
    assert reason_of(parse_health, bad).reason is Reason.BAD_FRAME


def test_protocol_ids_are_derived_from_the_version():
    v = frames.PROTOCOL_VERSION
    assert (FWD, BWD, STATE, HEALTH, MORPH) == PROTOCOLS == tuple(EXCHANGES)
    assert PROTOCOLS == tuple(f"/swarm-node/{name}/{v}" for name in ("fwd", "bwd", "state", "health", "morph"))
    assert FWD == "/swarm-node/fwd/1"  # version 1 on the wire


def test_check_request_per_protocol():
    check_request("/swarm-node/fwd/1", fwd())
    check_request("/swarm-node/health/1", dec(make_health_request()))
    assert reason_of(check_request, "/swarm-node/bwd/1", fwd()).reason is Reason.BAD_FRAME
    with pytest.raises(ValueError):
        check_request("/swarm-node/gossip/1", fwd())


# ---------------------------------------------------------------------------------------------
# State transfer


def model_state():
    g = torch.Generator().manual_seed(1)
    return {
        "blocks.0.attn.w": torch.randn(64, 32, generator=g),
        "blocks.0.norm": torch.randn(32, generator=g),
        "emb": torch.randn(10, 32, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "empty": torch.empty(0, 4),
    }


@pytest.mark.parametrize("max_chunk", [64, 1000, 4096, 1 << 20])
def test_state_transfer_round_trip(max_chunk):
    state = model_state()
    req = validate_state_request(dec(make_state_request(RUN, HASH, 1, max_chunk_bytes=max_chunk)), RUN, HASH, 1)
    assert req.max_chunk_bytes == max_chunk
    asm = StateAssembler(RUN, HASH, 1, {k: torch.empty_like(v, device="meta") for k, v in state.items()})
    chunks = [dec(b) for b in state_chunks(RUN, HASH, 1, 42, state, max_chunk_bytes=req.max_chunk_bytes)]
    assert all(c.nbytes <= max_chunk for c in chunks)
    assert [c.header["seq"] for c in chunks] == list(range(len(chunks)))
    assert [c.header["last"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    done = [asm.add(c) for c in chunks]
    assert done[-1] and not any(done[:-1]) and asm.version == 42
    out = asm.result()
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_state_request_refusals():
    assert reason_of(validate_state_request, dec(make_state_request("r2", HASH, 1)), RUN, HASH, 1).reason \
        is Reason.WRONG_RUN
    assert reason_of(validate_state_request, dec(make_state_request(RUN, HASH, 2)), RUN, HASH, 1).reason \
        is Reason.WRONG_STAGE


def test_state_assembler_refusals():
    state = model_state()
    chunks = [dec(b) for b in state_chunks(RUN, HASH, 1, 42, state, max_chunk_bytes=1000)]
    assert len(chunks) >= 4

    def fresh():
        return StateAssembler(RUN, HASH, 1, state)

    assert "seq 1; expected 0" in reason_of(fresh().add, chunks[1]).detail
    asm = fresh()
    asm.add(chunks[0])
    assert "seq 0; expected 1" in reason_of(asm.add, chunks[0]).detail  # replay
    assert reason_of(StateAssembler(RUN, HASH, 2, state).add, chunks[0]).reason is Reason.WRONG_STAGE
    assert reason_of(StateAssembler("r2", HASH, 1, state).add, chunks[0]).reason is Reason.WRONG_RUN
    # the joiner's model has no such tensor / a different shape / a different dtype
    assert "not in this stage" in reason_of(StateAssembler(RUN, HASH, 1, {"x": torch.zeros(1)}).add,
                                            chunks[0]).detail
    other = dict(state, **{"blocks.0.norm": torch.zeros(33)})
    asm = StateAssembler(RUN, HASH, 1, other)
    with pytest.raises(ProtocolError, match="shape"):
        for c in chunks:
            asm.add(c)
    other = dict(state, **{"blocks.0.attn.w": torch.zeros(64, 32, dtype=torch.float16)})
    with pytest.raises(ProtocolError, match="dtype"):
        StateAssembler(RUN, HASH, 1, other).add(chunks[0])
    # stream ended early: last chunk of a shorter transfer
    short = dec(make_state_chunk(RUN, HASH, 1, 42, 0, True, [("step", state["step"])]))
    assert "ended without" in reason_of(fresh().add, short).detail
    # overlapping slices, out-of-range slice, whole-and-parts, version change, chunk after last
    w = state["blocks.0.attn.w"].reshape(-1)
    overlap = dec(make_state_chunk(RUN, HASH, 1, 42, 0, False, [("w#0", w[:10]), ("w#5", w[5:15])],
                                   parts={"w#0": ("blocks.0.attn.w", 0, [64, 32]),
                                          "w#5": ("blocks.0.attn.w", 5, [64, 32])}))
    assert "overlaps" in reason_of(fresh().add, overlap).detail
    past = dec(make_state_chunk(RUN, HASH, 1, 42, 0, False, [("w#2040", w[:10])],
                                parts={"w#2040": ("blocks.0.attn.w", 2040, [64, 32])}))
    assert "outside" in reason_of(fresh().add, past).detail
    asm = fresh()
    asm.add(dec(make_state_chunk(RUN, HASH, 1, 42, 0, False, [("blocks.0.attn.w", state["blocks.0.attn.w"])])))
    part = dec(make_state_chunk(RUN, HASH, 1, 42, 1, False, [("w#0", w[:10])],
                                parts={"w#0": ("blocks.0.attn.w", 0, [64, 32])}))
    assert "whole and in parts" in reason_of(asm.add, part).detail
    asm = fresh()
    asm.add(chunks[0])
    moved = dec(make_state_chunk(RUN, HASH, 1, 43, 1, False, []))
    assert "changed mid-transfer" in reason_of(asm.add, moved).detail
    asm = fresh()
    for c in chunks:
        asm.add(c)
    assert "after the last" in reason_of(asm.add, chunks[-1]).detail
    assert reason_of(fresh().result).reason is Reason.BAD_FRAME


# ---------------------------------------------------------------------------------------------
# docs/PROTOCOL.md agrees with the code


def doc_table(heading: str, nth: int = 0) -> list[list[str]]:
    """Rows (cells without backticks) of the nth table under a '## heading' / '### heading'."""
    text = DOC.read_text()
    m = re.search(rf"^#+ {re.escape(heading)}\s*$", text, re.M)
    assert m, f"PROTOCOL.md has no section {heading!r}"
    section = text[m.end():]
    nxt = re.search(r"^#+ ", section, re.M)
    section = section[: nxt.start()] if nxt else section
    tables = re.findall(r"((?:^\|.*\|\s*$\n?)+)", section, re.M)
    assert len(tables) > nth, f"section {heading!r} has {len(tables)} tables"
    rows = [[c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
            for line in tables[nth].strip().splitlines()]
    return [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]  # drop header and rule


def test_doc_reason_codes_match_code():
    assert [r[0] for r in doc_table("Reason codes")] == [r.value for r in Reason]


def test_doc_message_types_and_required_fields_match_code():
    rows = doc_table("Message types")
    assert [r[0] for r in rows] == list(frames.MESSAGE_TYPES) == list(REQUIRED_FIELDS)
    for r in rows:
        doc_fields = tuple(f.strip() for f in r[3].split(",")) if r[3] != "(none)" else ()
        assert doc_fields == REQUIRED_FIELDS[r[0]], r[0]


def doc_fields(heading: str, scopes: dict[str, str]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """(required, optional) field names per message type, from the field table under ``heading``.

    A row names one or more fields (``run, manifest``). It is optional when its type or the scope
    of its meaning (the text before the first colon) says ``optional``. ``scopes`` maps each
    message type to the word that limits a row to it: a row whose meaning starts with
    ``"<word> only"`` or contains ``"<word>:"`` applies to that type alone (or to the types it
    names); every other row applies to all of them."""
    out: dict[str, tuple[list[str], list[str]]] = {t: ([], []) for t in scopes}
    for cells in doc_table(heading):
        names, typ, meaning = [n.strip() for n in cells[0].split(",")], cells[1], cells[2]
        scope = meaning.split(":")[0]
        optional = "optional" in typ or "optional" in scope
        limited = [t for t, word in scopes.items() if meaning.startswith(f"{word} only") or f"{word}:" in meaning]
        for t in limited or scopes:
            out[t][1 if optional else 0].extend(names)
    return {t: (tuple(req), tuple(opt)) for t, (req, opt) in out.items()}


def test_doc_field_tables_match_required_and_optional_fields():
    tables = {
        "fwd and bwd": {"fwd": "fwd", "bwd": "bwd"},
        "ack": {"ack": "ack"},
        "reject": {"reject": "reject"},
        "state-request and state-chunk": {"state-request": "request", "state-chunk": "chunk"},
        "morph-seed": {"morph-seed": "morph-seed"},
    }
    seen = set()
    for heading, scopes in tables.items():
        for mtype, (required, optional) in doc_fields(heading, scopes).items():
            assert required == REQUIRED_FIELDS[mtype], (heading, mtype, required)
            assert optional == OPTIONAL_FIELDS[mtype], (heading, mtype, optional)
            seen.add(mtype)
    # health-request and health are described in prose: no fields / one required map
    assert seen | {"health-request", "health"} == set(frames.MESSAGE_TYPES) == set(OPTIONAL_FIELDS)
    assert REQUIRED_FIELDS["health-request"] == OPTIONAL_FIELDS["health-request"] == OPTIONAL_FIELDS["health"] == ()
    text = DOC.read_text()
    assert "`health-request` has no fields. `health` has `status`" in text
    # the skip-only fields are documented as such
    rows = {r[0]: r for r in doc_table("fwd and bwd")}
    for f in SKIP_ONLY_FIELDS:
        assert rows[f][2].startswith("bwd only, optional, with skip only:"), rows[f]
    assert all(f"{v.value} (" in rows["refused"][2] for v in Refused), rows["refused"]


def test_doc_stream_protocols_match_code():
    rows = doc_table("Streams")
    assert {r[0]: r[1] for r in rows} == {p: req for p, (req, _) in EXCHANGES.items()}
    for r in rows:
        replies = set(re.findall(r"[a-z]+(?:-[a-z]+)*", r[2])) & set(frames.MESSAGE_TYPES)
        assert replies == set(EXCHANGES[r[0]][1]), r[0]


def test_doc_dtypes_and_limits_match_code():
    assert {r[0]: int(r[1]) for r in doc_table("Tensor table and body")} == frames.ITEMSIZE
    limits = {r[0]: r[1] for r in doc_table("Limits")}
    defaults = frames.Limits()
    assert limits == {
        "max_header_bytes": str(defaults.max_header_bytes),
        "max_body_bytes": str(defaults.max_body_bytes),
        "max_tensors": str(defaults.max_tensors),
        "max_ndim": str(frames.MAX_NDIM),
        "max_name_len": str(frames.MAX_NAME_LEN),
        "max_id_len": str(MAX_ID_LEN),
        "max_route": str(MAX_ROUTE),
        "max_detail": str(MAX_DETAIL),
    }
    assert defaults.max_header_bytes == frames.MAX_HEADER_BYTES == 65536


def test_doc_frame_header_fields():
    rows = doc_table("Header")
    assert [r[0] for r in rows] == ["v", "type", "tensors", "body_len"]
    header = msgpack.unpackb(encode_frame_bytes({"type": "ack"})[8:])
    assert set(header) == {"v", "type", "tensors", "body_len"}


def test_doc_worked_example_is_byte_exact():
    text = DOC.read_text()
    block = text[text.index("### Worked example"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")]
    expected = bytes.fromhex("".join(line[6:] for line in block.strip().splitlines()))
    data = b"".join(make_fwd(run="demo", manifest_hash="9f2c", mb=7, stage=0, version=3, route=["QmA"],
                             c=torch.tensor([[[1.0], [-2.0]]]), ids=torch.tensor([[72, 105]]),
                             codec="subspace", sent_ms=1700000000000))
    assert data == expected
    assert f"these {len(data)} bytes" in text
    (hlen,) = struct.unpack(">I", data[4:8])
    assert f"header length {hlen}" in text and f"offset {hex(8 + hlen)}" in text


def test_doc_version_rule_matches_the_detail_the_code_sends():
    head = msgpack.packb({"v": 2, "type": "fwd", "tensors": [], "body_len": 0})
    err = reason_of(FrameDecoder().feed, MAGIC + struct.pack(">I", len(head)) + head)
    assert err.reason is Reason.BAD_FRAME
    quoted = re.search(r'\("(protocol version 2 is newer than this node\'s 1); \.\.\."\)', DOC.read_text())
    assert quoted and err.detail.startswith(quoted.group(1))


# ---------------------------------------------------------------------------------------------
# morph epochs: the epoch field, morph seeds


def test_epoch_field_round_trips_and_is_absent_when_morphing_is_off():
    assert "epoch" not in fwd().header and validate_fwd(fwd(), expect_fwd()).epoch == 0
    assert validate_fwd(fwd(epoch=7), expect_fwd()).epoch == 7
    assert validate_bwd(bwd(epoch=3), expect_bwd()).epoch == 3
    skip = validate_bwd(bwd(grad=None, skip=Reason.WRONG_EPOCH, epoch=4), expect_bwd())
    assert (skip.skip, skip.epoch) == ("wrong-epoch", 4)
    for bad in (-1, "2", True, 1.5):
        assert "'epoch'" in reason_of(validate_fwd, _fwd_with_epoch(bad), expect_fwd()).detail
    rej = parse_reply(dec(make_reject(Reason.WRONG_EPOCH, "in epoch 5", mb=1, epoch=5)))
    assert (rej.reason, rej.epoch) == (Reason.WRONG_EPOCH, 5)
    assert parse_reply(dec(make_reject(Reason.BUSY, "full"))).epoch is None


def _fwd_with_epoch(value):
    from protocol import encode_frame

    h = {"type": "fwd", "run": RUN, "manifest": HASH, "mb": 11, "stage": 1, "version": 20, "route": ROUTE[:2],
         "codec": "subspace", "sent_ms": 5, "epoch": value}
    return dec(encode_frame(h, [("ids", torch.zeros(2, 5, dtype=torch.long)), ("c", torch.randn(2, 5, K))]))


def test_state_chunks_carry_one_epoch():
    state = {"w": torch.randn(300), "b": torch.randn(4)}
    asm = StateAssembler(RUN, HASH, 1, state)
    for buffers in state_chunks(RUN, HASH, 1, 9, state, max_chunk_bytes=512, epoch=6):
        asm.add(dec(buffers))
    assert asm.done and asm.epoch == 6 and asm.version == 9
    plain = StateAssembler(RUN, HASH, 1, state)
    for buffers in state_chunks(RUN, HASH, 1, 9, state):
        plain.add(dec(buffers))
    assert plain.epoch == 0
    mixed = StateAssembler(RUN, HASH, 1, state)
    chunks = list(state_chunks(RUN, HASH, 1, 9, state, max_chunk_bytes=512, epoch=6))
    mixed.add(dec(chunks[0]))
    second = dec(chunks[1])
    second.header["epoch"] = 7
    assert "epoch 7 changed" in reason_of(mixed.add, second).detail


def test_morph_seed_round_trip_keeps_the_seed_out_of_the_header_and_repr():
    seed = bytes(range(MORPH_SEED_BYTES))
    data = b"".join(make_morph_seed(RUN, HASH, 1, 1, 4, seed))
    (hlen,) = struct.unpack(">I", data[4:8])
    assert seed not in data[: 8 + hlen] and data[8 + hlen:] == seed  # the body is the seed, the header is not
    frame = dec([data])
    got = validate_morph_seed(frame, RUN, HASH, 2)  # the receiving side: stage 2 holds boundary 1
    assert (got.stage, got.boundary, got.epoch, got.seed) == (1, 1, 4, seed)
    assert seed.hex() not in repr(got) and str(list(seed[:4])) not in repr(got)
    assert validate_morph_seed(frame, RUN, HASH, 1).seed == seed  # the sending side's replicas too
    with pytest.raises(ValueError):
        make_morph_seed(RUN, HASH, 1, 1, 4, b"short")


def test_morph_seed_refusals():
    seed = bytes(MORPH_SEED_BYTES)
    assert reason_of(validate_morph_seed, dec(make_morph_seed(RUN, HASH, 1, 1, 4, seed)), RUN, HASH, 3).reason \
        is Reason.WRONG_STAGE  # stage 3 holds boundaries 2 and 3
    assert reason_of(validate_morph_seed, dec(make_morph_seed(RUN, HASH, 2, 1, 4, seed)), RUN, HASH, 1).reason \
        is Reason.WRONG_STAGE  # the downstream side does not deal
    assert reason_of(validate_morph_seed, dec(make_morph_seed("other", HASH, 1, 1, 4, seed)), RUN, HASH, 1).reason \
        is Reason.WRONG_RUN
    from protocol import encode_frame

    h = {"type": "morph-seed", "run": RUN, "manifest": HASH, "stage": 1, "boundary": 1, "epoch": 2}
    for tensors in ([], [("seed", torch.zeros(16, dtype=torch.uint8))], [("seed", torch.zeros(32))],
                    [("seed", torch.zeros(32, dtype=torch.uint8)), ("x", torch.zeros(1, dtype=torch.uint8))]):
        assert reason_of(validate_morph_seed, dec(encode_frame(h, tensors)), RUN, HASH, 1).reason is Reason.BAD_FRAME
    assert reason_of(validate_morph_seed, dec(encode_frame({**h, "epoch": -1}, [("seed", torch.zeros(32, dtype=torch.uint8))])),
                     RUN, HASH, 1).reason is Reason.BAD_FRAME
