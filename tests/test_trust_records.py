"""The DHT record validator against a stranger who forges nothing: junk subkeys, keys that are slow
to verify with, another manifest of the same organiser, multihash forms no key of ours makes,
and clocks that disagree. The validator alone, and real hivemind DHTs on loopback where what an
honest reader sees is the point (docs/THREAT_MODEL.md)."""

from __future__ import annotations

import asyncio
import functools

import hivemind
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

import node.net.records as records
import node.net.run_keys as run_keys
from node.net import Membership, PeerRecord, start_dht, stop_dht
from node.net.identity import write_identity
from node.net.membership import run_namespace
from node.net.records import (
    MAX_CLOCK_SKEW_S,
    MAX_RECORD_TTL_S,
    ForgeryCounter,
    RunScope,
    SwarmRecordValidator,
    averaging_key_prefix,
    dht_key_id,
    manifest_subkey,
    peer_subkey,
    run_key,
)
from node.ops.manifest_cmd import sign_manifest
from security import OrganiserKey, PeerKey, new_ed25519_key, peer_id_of_public_key, peer_key_problem
from security.identity import KEY_RSA, key_message, peer_multihash
from stages import consensus_dict, load_manifest, manifest_hash
from tests.helpers.procs import assert_no_p2pd_left

KEY = b"\x01" * 20  # a DHT key id no run of the tests has
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _rsa_public_blob(e: int, n: int) -> bytes:
    """A libp2p PublicKey protobuf of the RSA key (e, n): no private key is needed to write one."""
    der = rsa.RSAPublicNumbers(e, n).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key_message(KEY_RSA, der)


def _rsa_peer_key(bits: int) -> PeerKey:
    private = rsa.generate_private_key(65537, bits)
    der = private.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    return PeerKey(key_message(KEY_RSA, der))


def _signed(signer: PeerKey, key: bytes, subkey, value, expiration: float) -> DHTRecord:
    """What hivemind hands the validator for ``signer``'s own store of ``value`` under ``subkey``."""
    record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)
    return DHTRecord(key, record.subkey, SwarmRecordValidator(signer).sign_value(record), expiration)


def _announcement(key: PeerKey, record_key: bytes = KEY, expiration: float | None = None, **fields) -> DHTRecord:
    value = {"peer_id": key.peer_id, "stage": 1, "state": "online", "capacity": 100.0, **fields}
    return _signed(key, record_key, peer_subkey(key.peer_id), value, expiration or get_dht_time() + 20)


def _published(manifest) -> dict:
    return {"hash": manifest_hash(manifest), "manifest": consensus_dict(manifest), "protocol": 1,
            "organiser": manifest.run.organiser, "signature": manifest.signature.ed25519}


def _manifest_record(manifest, record_key: bytes, expiration: float | None = None) -> DHTRecord:
    return DHTRecord(record_key, MSGPackSerializer.dumps(manifest_subkey(manifest.run.organiser)),
                     MSGPackSerializer.dumps(_published(manifest)), expiration or get_dht_time() + 60)


def _manifest_key(manifest) -> bytes:
    return dht_key_id(run_key(run_namespace(manifest), "manifest"))


# ----------------------------------------------------------------------------- the validator alone


def test_subkeys_of_no_record_type_are_refused_and_counted():
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    junk = ["junk:1", "other", "", 7, 3.5, [1, 2], b"\x13\x40" + b"\x00" * 64, b"\x00\x05hello", "peer" * 40]
    for subkey in junk:
        rec = DHTRecord(KEY, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps({"x": 1}), get_dht_time() + 5)
        assert not v.validate(rec), subkey
    assert counter.snapshot()["unknown"] == len(junk)
    # a subkey past the bound is refused without being read
    assert not v.validate(DHTRecord(KEY, b"\xda\x10\x00" + b"a" * 4096, b"\xc0", get_dht_time() + 5))
    assert counter.snapshot()["unknown"] == len(junk) + 1


def test_each_record_type_bounds_its_value_before_reading_it(monkeypatch):
    me = PeerKey(new_ed25519_key())
    v = SwarmRecordValidator()
    many = [f"/ip4/10.0.0.{i % 250}/tcp/{40000 + i}/p2p/{me.peer_id}" for i in range(200)]
    big = _announcement(me, maddrs=many)  # validly signed, but 200 addresses: 15 KiB
    assert len(big.value) > records.RECORD_TYPES[0].max_value_bytes
    judged = []
    monkeypatch.setattr(records, "peer_key_problem", lambda *a: judged.append(a) or peer_key_problem(*a),
                        raising=False)
    assert not v.validate(big) and judged == []
    assert v.validate(_announcement(me, maddrs=many[:16])) and len(judged) == 1


@pytest.mark.timeout(120)
def test_the_largest_honest_records_fit_their_bounds():
    """An RSA-4096 node announcing 16 long addresses, and its averaging declaration."""
    key = _rsa_peer_key(4096)
    relay = "/ip6/2001:db8:1234:5678:9abc:def0:1234:5678/tcp/31337/p2p/" + key.peer_id + "/p2p-circuit"
    v = SwarmRecordValidator()
    assert v.validate(_announcement(key, maddrs=[relay] * 16, throughput=1e12, queue=10**6, version=10**9))
    assert v.validate(_signed(key, KEY, key.peer_id_bytes, True, get_dht_time() + 20))


def test_slow_keys_are_refused_before_any_signature_is_verified(monkeypatch):
    """An RSA key with a 3071-bit exponent costs a hundred honest verifications; nobody needs its
    private key to write records with it (the signature can be garbage)."""
    n = rsa.generate_private_key(65537, 3072).public_key().public_numbers().n
    slow = _rsa_public_blob((1 << 3070) | 1, n)
    assert "exponent" in peer_key_problem(slow)
    verified = []
    real_verify = records.verify_peer_signature
    monkeypatch.setattr(records, "verify_peer_signature", lambda *a: verified.append(1) or real_verify(*a))
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    peer_id = peer_id_of_public_key(slow)
    value = MSGPackSerializer.dumps({"peer_id": peer_id, "stage": 1, "state": "online"})
    garbage = b"\x01" * 384
    for i in range(50):  # one store request's worth
        wrapped = records._WRAP + MSGPackSerializer.dumps([value, slow, garbage])
        rec = DHTRecord(KEY, MSGPackSerializer.dumps(peer_subkey(peer_id)), wrapped, get_dht_time() + 20 + i)
        assert not v.validate(rec)
        multihash = peer_multihash(slow)
        wrapped = records._WRAP + MSGPackSerializer.dumps([MSGPackSerializer.dumps(True), slow, garbage])
        assert not v.validate(DHTRecord(KEY, MSGPackSerializer.dumps(multihash), wrapped, get_dht_time() + 20 + i))
    assert verified == [] and counter.snapshot()["peer"] == 50 and counter.snapshot()["averaging"] == 50
    # an honest key still verifies (and is the only kind that reaches the verification)
    me = PeerKey(new_ed25519_key())
    assert v.validate(_announcement(me)) and verified == [1]


def test_only_cheap_key_kinds_and_sizes_are_accepted():
    ed = PeerKey(new_ed25519_key())
    assert peer_key_problem(ed.public_key) is None
    assert peer_key_problem(ed.public_key, b"\x00" * 64) is None
    assert "64 bytes" in peer_key_problem(ed.public_key, b"\x00" * 65)
    n3072 = rsa.generate_private_key(65537, 3072).public_key().public_numbers().n
    assert peer_key_problem(_rsa_public_blob(65537, n3072)) is None
    assert "exponent 3 " in peer_key_problem(_rsa_public_blob(3, n3072))
    assert "exponent" in peer_key_problem(_rsa_public_blob(2**255 + 1, n3072))
    small = rsa.generate_private_key(65537, 1024).public_key().public_numbers().n
    assert "1024 bits" in peer_key_problem(_rsa_public_blob(65537, small))
    assert "at most" in peer_key_problem(_rsa_public_blob(65537, (1 << 8191) | 1))  # 8192 bits: over the size bound
    assert "6000 bits" in peer_key_problem(_rsa_public_blob(65537, (1 << 5999) | 1))
    assert "key type 2" in peer_key_problem(key_message(2, b"\x02" * 33))  # secp256k1
    assert "32 bytes" in peer_key_problem(key_message(1, b"\x00" * 31))
    assert "not a libp2p public key" in peer_key_problem(b"\xff\xff")
    # a node refuses to run with such a key of its own: every peer would refuse its records
    weak = rsa.generate_private_key(65537, 1024).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    with pytest.raises(ValueError, match="1024 bits"):
        PeerKey(key_message(KEY_RSA, weak))


def test_a_manifest_is_valid_only_under_its_own_run_key():
    org = OrganiserKey.generate()
    run_a = sign_manifest(load_manifest("test"), org)
    run_b = sign_manifest(load_manifest("test").replace(run={"id": "swarm-test-b"}), org)
    counter = ForgeryCounter()
    for v in (SwarmRecordValidator(counter=counter), SwarmRecordValidator(scope=RunScope.of(run_a))):
        assert v.validate(_manifest_record(run_a, _manifest_key(run_a)))
        assert v.validate(_manifest_record(run_b, _manifest_key(run_b)))
        # run-b's manifest, correctly signed by the same organiser, under run-a's key
        assert not v.validate(_manifest_record(run_b, _manifest_key(run_a), get_dht_time() + 200))
        assert not v.validate(_manifest_record(run_a, KEY))
    # an unsigned run's manifest under a signed run's key, and under its own
    unsigned = load_manifest("test")
    v = SwarmRecordValidator(counter=counter)
    assert not v.validate(_manifest_record(unsigned, _manifest_key(run_a)))
    assert v.validate(_manifest_record(unsigned, _manifest_key(unsigned)))
    assert counter.snapshot()["manifest"] == 3


def test_averaging_subkeys_are_the_project_multihashes_within_the_expiry_cap():
    me, rsa_key = PeerKey(new_ed25519_key()), _rsa_peer_key(2048)
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    for key in (me, rsa_key):  # identity multihash (Ed25519), sha2-256 (RSA)
        assert v.validate(_signed(key, KEY, key.peer_id_bytes, True, get_dht_time() + 20))
    # a well-formed sha2-512 multihash: no key of ours hashes to one
    sha512 = b"\x13\x40" + bytes(range(64))
    assert not v.validate(DHTRecord(KEY, MSGPackSerializer.dumps(sha512), MSGPackSerializer.dumps(True),
                                    get_dht_time() + 10**9))
    assert counter.snapshot()["unknown"] == 1
    far = get_dht_time() + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S + 5
    assert not v.validate(_signed(me, KEY, me.peer_id_bytes, True, far))
    assert not v.validate(_signed(me, KEY, me.peer_id_bytes, {"x": 1}, get_dht_time() + 20))  # not a bool
    assert counter.snapshot()["averaging"] == 2


@pytest.mark.parametrize("behind", [0.0, 0.5, MAX_CLOCK_SKEW_S - 0.1])
def test_a_record_at_the_writer_cap_is_accepted_by_a_reader_whose_clock_is_behind(monkeypatch, behind):
    writer_now = 1_000_000.0
    me = PeerKey(new_ed25519_key())
    org = OrganiserKey.generate()
    signed = sign_manifest(load_manifest("test"), org)
    expiry = writer_now + MAX_RECORD_TTL_S - 0.1
    monkeypatch.setattr(records, "get_dht_time", lambda: writer_now - behind)
    v = SwarmRecordValidator()
    assert v.validate(_announcement(me, expiration=expiry))
    assert v.validate(_signed(me, KEY, me.peer_id_bytes, True, expiry))
    assert v.validate(_manifest_record(signed, _manifest_key(signed), expiry))


def test_a_reader_refuses_only_beyond_the_cap_and_the_allowance(monkeypatch):
    now = 1_000_000.0
    me = PeerKey(new_ed25519_key())
    monkeypatch.setattr(records, "get_dht_time", lambda: now)
    monkeypatch.setattr(run_keys, "get_dht_time", lambda: now)  # a writer's clock (writer_expiration)
    v = SwarmRecordValidator()
    assert v.validate(_announcement(me, expiration=now + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S - 0.1))
    assert not v.validate(_announcement(me, expiration=now + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S + 0.1))
    assert not v.validate(_announcement(me, expiration=float("inf")))
    # a writer never claims more than the cap from its own clock
    assert records.writer_expiration(10 * MAX_RECORD_TTL_S) == now + MAX_RECORD_TTL_S
    assert records.writer_expiration(20) == now + 20


def test_a_run_scope_keeps_each_record_type_under_its_own_keys():
    manifest = sign_manifest(load_manifest("test"), OrganiserKey.generate())
    scope = RunScope.of(manifest)
    ns = run_namespace(manifest)
    peers, manifest_key = dht_key_id(run_key(ns, "peers")), dht_key_id(run_key(ns, "manifest"))
    org = manifest.run.organiser
    group = dht_key_id(f"{averaging_key_prefix(manifest.run.id, 2, org)}.0b{12345:016b}")  # stage 2, slot 12345
    other_run = dht_key_id("swarm-node/another-run/0123456789abcdef/peers")
    assert (scope.role(peers), scope.role(manifest_key), scope.role(group), scope.role(other_run)) == \
        ("peers", "manifest", "averaging", None)
    assert scope.role(dht_key_id(f"{averaging_key_prefix(manifest.run.id, 3, org)}.0b{0:016b}")) is None  # no stage 3
    # the same run id under another organiser (or unsigned) is another run
    assert scope.role(dht_key_id(f"{averaging_key_prefix(manifest.run.id, 2)}.0b{12345:016b}")) is None
    me = PeerKey(new_ed25519_key())
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter, scope=scope)
    declare = functools.partial(_signed, me, subkey=me.peer_id_bytes, value=True, expiration=get_dht_time() + 20)
    # each type under its own key, and under another run's keys (a DHT may serve several runs)
    assert v.validate(_announcement(me, peers)) and v.validate(_announcement(me, other_run))
    assert v.validate(declare(key=group)) and v.validate(declare(key=other_run))
    assert v.validate(_manifest_record(manifest, manifest_key))
    # and never under another type's key of this run
    assert not v.validate(_announcement(me, manifest_key)) and not v.validate(_announcement(me, group))
    assert not v.validate(declare(key=peers)) and not v.validate(declare(key=manifest_key))
    assert counter.snapshot() == {"peer": 2, "manifest": 0, "averaging": 2, "plain": 0, "unknown": 0, "unread": 0}


def test_the_averaging_keys_are_the_averager_s_own():
    from hivemind.averaging.key_manager import GroupKeyManager

    from node.net.averaging import averaging_prefix

    from security import OrganiserKey

    organiser = OrganiserKey.generate().public
    for run in ("swarm-test", "a.b.c", "x_y"):
        for org in ("", organiser):  # unsigned and signed runs: the keys the averager uses are the scope's
            scope = RunScope(run, org, n_stages=3)
            for stage in range(3):
                assert scope.role(dht_key_id(f"{averaging_prefix(run, stage, org)}.0b{4242:016b}")) == "averaging"
            assert scope.role(dht_key_id(f"{averaging_prefix(run, 1, organiser if not org else '')}.0b{7:016b}")) is None
    for key in ("swarm-node/swarm-test/peers", "a.b.c_stage1_avg.0b0101010101010101", "é" * 40):
        assert dht_key_id(key) == DHTID.generate(source=key).to_bytes()  # hivemind's DHTRecord.key
    scope = RunScope("a.b.c", "", n_stages=2)
    manager = GroupKeyManager.__new__(GroupKeyManager)  # current_key only: no DHT needed
    manager.prefix, manager.group_bits = averaging_prefix("a.b.c", 1), format(65535, "016b")
    assert scope.role(dht_key_id(manager.current_key)) == "averaging"


# ----------------------------------------------------------------------------- real DHTs on loopback


def _stranger(initial_peers) -> hivemind.DHT:
    """A plain hivemind DHT client: no validator, stores whatever it likes."""
    return hivemind.DHT(initial_peers=initial_peers, start=True, host_maddrs=LOOPBACK, use_relay=False,
                        use_auto_relay=False, auto_nat=False, nat_port_map=False)


async def _store_junk(key: str, n: int, size: int, dht, node) -> None:
    """In the stranger's DHT process: ``n`` junk subkeys under ``key`` in one go."""
    exp = get_dht_time() + 100  # within the cap: refused for what they are, not for their expiry
    await node.store_many([key] * n, [b"j" * size] * n, exp, subkeys=[f"junk:{i}" for i in range(n)])


async def _stored_entries(key: str, dht, node) -> int:
    """In a DHT's process: how many entries its own storage holds under ``key``."""
    item = node.protocol.storage.get(DHTID.generate(source=key))
    return 0 if item is None else len(item.value)


@pytest.fixture
def swarm(tmp_path):
    """A validating bootstrap node (counting refusals), an honest node with its identity key, a
    validating reader and a stranger's plain DHT client; all stopped afterwards."""
    write_identity(tmp_path / "honest.key")
    counter = ForgeryCounter()
    dhts = []
    try:
        boot = start_dht([], LOOPBACK, local=True, forgeries=counter)
        dhts.append(boot)
        peers = [str(m) for m in boot.get_visible_maddrs()]
        honest = start_dht(peers, LOOPBACK, identity_path=str(tmp_path / "honest.key"), local=True)
        dhts.append(honest)
        reader = start_dht(peers, LOOPBACK, local=True)
        dhts.append(reader)
        stranger = _stranger(peers)
        dhts.append(stranger)
        yield boot, honest, reader, stranger, counter
    finally:
        for d in reversed(dhts):
            stop_dht(d)
        assert_no_p2pd_left()


@pytest.mark.timeout(120)
def test_a_stranger_s_thousand_junk_subkeys_never_reach_an_honest_reader(swarm, test_manifest):
    boot, honest, reader, stranger, counter = swarm
    writer = Membership(honest, test_manifest, ttl=60)
    assert asyncio.run(writer.aannounce(PeerRecord(writer.peer_id, 1, "online", capacity=50.0)))
    key = writer.key_peers
    stranger.run_coroutine(functools.partial(_store_junk, key, 1000, 1024))
    # the validating nodes it reached keep the honest announcement only, and counted the junk
    assert boot.run_coroutine(functools.partial(_stored_entries, key)) == 1
    assert honest.run_coroutine(functools.partial(_stored_entries, key)) == 1
    assert counter.snapshot()["unknown"] > 0

    found = reader.get(key, latest=True)
    assert found is not None and list(found.value) == [writer.subkey]
    assert len(MSGPackSerializer.dumps({k: v.value for k, v in found.value.items()})) < 4096
    seen = Membership(reader, test_manifest).peers()
    assert [(p.peer_id, p.capacity) for p in seen] == [(writer.peer_id, 50.0)]


@pytest.mark.timeout(120)
def test_another_run_s_manifest_by_the_same_organiser_cannot_replace_this_run_s(swarm):
    boot, honest, reader, stranger, counter = swarm
    org = OrganiserKey.generate()
    run_a = sign_manifest(load_manifest("test"), org)
    run_b = sign_manifest(load_manifest("test").replace(run={"id": "swarm-test-b"}, optim={"lr": 0.5}), org)
    publisher = Membership(honest, run_a, ttl=20)
    assert publisher.check_and_publish_manifest() is False  # nothing published yet: published now
    # run-b's manifest, genuine and signed by the same organiser, under run-a's key, living longer
    stranger.store(publisher.key_manifest, _published(run_b), get_dht_time() + 250, subkey=manifest_subkey(org.public))
    # a new node of run-a reads run-a's manifest and joins (no mismatch), and so does the publisher
    assert Membership(reader, run_a).check_and_publish_manifest() is True
    assert publisher.check_and_publish_manifest() is True
    found = reader.get(publisher.key_manifest, latest=True)
    assert found.value[publisher.manifest_subkey].value["hash"] == manifest_hash(run_a)
    assert counter.snapshot()["manifest"] >= 1  # the validating node it reached refused it
