"""Trust among strangers, without a network: organiser-signed manifests, identity keys and the DHT
record validator that binds each record to its writer (docs/THREAT_MODEL.md)."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from node.net.membership import run_namespace
from node.net.records import (
    MAX_RECORD_TTL_S,
    ForgeryCounter,
    SwarmRecordValidator,
    dht_key_id,
    manifest_subkey,
    peer_subkey,
    run_key,
)
from node.ops.manifest_cmd import sign_manifest
from security import (
    OrganiserKey,
    PeerKey,
    manifest_signature_problem,
    new_ed25519_key,
    organiser_fingerprint,
    peer_id_of_public_key,
    verify_peer_signature,
)
from stages import consensus_dict, load_manifest, manifest_hash, manifest_toml

KEY = b"\x01" * 20  # a DHT key id: the validator never sees the key in clear


def _peer_record(validator, peer_id, value, expiration=None, subkey=None):
    """What hivemind hands the validator for a store of ``value`` under ``peer:<peer_id>``."""
    record = DHTRecord(KEY, MSGPackSerializer.dumps(subkey or peer_subkey(peer_id)), MSGPackSerializer.dumps(value),
                       expiration or get_dht_time() + 20)
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def test_peer_keys_sign_and_their_peer_id_is_bound_to_the_public_key():
    key = PeerKey(new_ed25519_key())
    assert key.peer_id.startswith("12D3KooW") and peer_id_of_public_key(key.public_key) == key.peer_id
    sig = key.sign(b"hello")
    assert verify_peer_signature(key.public_key, b"hello", sig)
    assert not verify_peer_signature(key.public_key, b"hellO", sig)
    other = PeerKey(new_ed25519_key())
    assert not verify_peer_signature(other.public_key, b"hello", sig)
    assert not verify_peer_signature(b"garbage", b"hello", sig)


def test_a_signed_manifest_verifies_and_any_change_breaks_it():
    org = OrganiserKey.generate()
    signed = sign_manifest(load_manifest("test"), org)
    assert manifest_signature_problem(signed) is None
    assert signed.run.organiser == org.public
    # the signature is not a consensus field; the organiser is
    assert "signature" not in consensus_dict(signed) and consensus_dict(signed)["run"]["organiser"] == org.public
    assert "not signed" in manifest_signature_problem(load_manifest("test"))
    tampered = signed.replace(optim={"lr": 0.5})
    assert "does not verify" in manifest_signature_problem(tampered)
    # another organiser's signature over the same fields does not verify with this organiser key
    other = OrganiserKey.generate()
    wrong = signed.replace(signature={"ed25519": other.sign_manifest(manifest_hash(signed))})
    assert "does not verify" in manifest_signature_problem(wrong)
    # re-signing with the other key is a different run (its organiser and namespace)
    resigned = sign_manifest(signed, other)
    assert manifest_signature_problem(resigned) is None and manifest_hash(resigned) != manifest_hash(signed)
    assert organiser_fingerprint(org.public) != organiser_fingerprint(other.public)


def test_a_signed_manifest_survives_its_toml_file(tmp_path):
    org = OrganiserKey.generate()
    signed = sign_manifest(load_manifest("default"), org)
    path = tmp_path / "run.toml"
    path.write_text(manifest_toml(signed))
    back = load_manifest(path)
    assert back == signed and manifest_signature_problem(back) is None


def test_organiser_keys_round_trip_and_refuse_garbage():
    key = OrganiserKey.generate()
    assert OrganiserKey.from_text(key.to_text()).public == key.public
    with pytest.raises(ValueError, match="not an organiser key"):
        OrganiserKey.from_text("hello\nworld\n")
    with pytest.raises(ValueError, match="does not decode"):
        OrganiserKey.from_text(key.to_text().splitlines()[0] + "\n!!!\n")


def test_the_validator_accepts_a_peer_own_record_and_strips_the_signature():
    key = PeerKey(new_ed25519_key())
    mine, reader = SwarmRecordValidator(key), SwarmRecordValidator()
    value = {"peer_id": key.peer_id, "stage": 1, "state": "online", "capacity": 100.0}
    record = _peer_record(mine, key.peer_id, value)
    assert reader.validate(record)
    assert MSGPackSerializer.loads(reader.strip_value(record)) == value


@pytest.mark.parametrize("forgery", ["claims-another-peer", "changed-field", "unsigned", "wrong-subkey",
                                     "far-future", "garbage"])
def test_the_validator_refuses_forged_peer_records_and_counts_them(forgery):
    victim, forger = PeerKey(new_ed25519_key()), PeerKey(new_ed25519_key())
    counter = ForgeryCounter()
    reader = SwarmRecordValidator(counter=counter)
    honest = {"peer_id": victim.peer_id, "stage": 1, "state": "online", "capacity": 100.0}
    if forgery == "claims-another-peer":  # the forger signs a draining record for the victim's peer id
        signed = _peer_record(SwarmRecordValidator(forger), forger.peer_id, {**honest, "state": "draining"})
        record = DHTRecord(KEY, MSGPackSerializer.dumps(peer_subkey(victim.peer_id)), signed.value,
                           signed.expiration_time)
    elif forgery == "changed-field":  # the victim's genuine record with an inflated capacity
        genuine = _peer_record(SwarmRecordValidator(victim), victim.peer_id, honest)
        inner, pub, sig = MSGPackSerializer.loads(genuine.value[5:])
        inflated = MSGPackSerializer.dumps({**honest, "capacity": 1e9})
        record = DHTRecord(KEY, genuine.subkey, genuine.value[:5] + MSGPackSerializer.dumps([inflated, pub, sig]),
                           genuine.expiration_time)
    elif forgery == "unsigned":
        record = DHTRecord(KEY, MSGPackSerializer.dumps(peer_subkey(victim.peer_id)),
                           MSGPackSerializer.dumps(honest), get_dht_time() + 20)
    elif forgery == "wrong-subkey":  # the forger's genuine signature on a record naming the victim
        record = _peer_record(SwarmRecordValidator(forger), forger.peer_id, honest)
    elif forgery == "far-future":  # genuine, but claims to live long enough to win every lookup
        record = _peer_record(SwarmRecordValidator(victim), victim.peer_id, honest,
                              expiration=get_dht_time() + 2 * MAX_RECORD_TTL_S)
    else:
        record = DHTRecord(KEY, MSGPackSerializer.dumps(peer_subkey(victim.peer_id)), b"SWNR1\xff\x00",
                           get_dht_time() + 20)
    assert not reader.validate(record)
    assert counter.snapshot() == {"peer": 1, "manifest": 0, "averaging": 0, "plain": 0, "unknown": 0, "unread": 0}


def _manifest_record(manifest, subkey=None, under=None, **overrides):
    """``manifest`` published under the manifest key of ``under``'s run (its own by default)."""
    value = {"hash": manifest_hash(manifest), "manifest": consensus_dict(manifest), "protocol": 1,
             "organiser": manifest.run.organiser, "signature": manifest.signature.ed25519, **overrides}
    key = dht_key_id(run_key(run_namespace(under or manifest), "manifest"))
    return DHTRecord(key, MSGPackSerializer.dumps(subkey or manifest_subkey(manifest.run.organiser)),
                     MSGPackSerializer.dumps(value), get_dht_time() + 60)


def test_the_validator_binds_the_published_manifest_to_its_organiser():
    org, forger = OrganiserKey.generate(), OrganiserKey.generate()
    signed = sign_manifest(load_manifest("test"), org)
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    assert v.validate(_manifest_record(signed))
    assert v.validate(_manifest_record(load_manifest("test")))  # an unsigned run's own subkey
    # a forger's manifest under the organiser's subkey: its own signature, or none
    forged = sign_manifest(signed.replace(optim={"lr": 0.5}), forger)
    assert not v.validate(_manifest_record(forged, subkey=manifest_subkey(org.public), under=signed))
    tampered = signed.replace(optim={"lr": 0.5})
    assert not v.validate(_manifest_record(tampered))  # the organiser's signature over other fields
    assert not v.validate(_manifest_record(signed, hash="0" * 64))  # a hash that is not the fields'
    # under its own organiser subkey a forger's manifest is valid, and is another run (namespace)
    assert v.validate(_manifest_record(forged))
    assert counter.snapshot() == {"peer": 0, "manifest": 3, "averaging": 0, "plain": 0, "unknown": 0, "unread": 0}


def test_averaging_announcements_are_bound_to_the_peer_they_announce():
    """hivemind's averager declares itself under its raw peer id bytes; those records are signed by
    the node's key, and nobody else can declare (or withdraw) that peer."""
    me, forger = PeerKey(new_ed25519_key()), PeerKey(new_ed25519_key())
    counter = ForgeryCounter()
    reader = SwarmRecordValidator(counter=counter)

    def declare(signer, peer_id_bytes, value=True):
        rec = DHTRecord(KEY, MSGPackSerializer.dumps(peer_id_bytes), MSGPackSerializer.dumps(value),
                        get_dht_time() + 20)
        return DHTRecord(rec.key, rec.subkey, SwarmRecordValidator(signer).sign_value(rec), rec.expiration_time)

    mine = declare(me, me.peer_id_bytes)
    assert reader.validate(mine) and MSGPackSerializer.loads(reader.strip_value(mine)) is True
    assert not reader.validate(declare(forger, me.peer_id_bytes, False))  # the forger's signature, my id
    assert not reader.validate(DHTRecord(KEY, MSGPackSerializer.dumps(me.peer_id_bytes),
                                         MSGPackSerializer.dumps(False), get_dht_time() + 20))  # unsigned
    assert counter.snapshot()["averaging"] == 2


def test_plain_values_are_refused_so_no_one_can_replace_a_dictionary():
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    plain = DHTRecord(KEY, MSGPackSerializer.dumps(None), MSGPackSerializer.dumps({"hash": "x"}), time.time() + 5)
    assert not v.validate(plain) and counter.snapshot()["plain"] == 1


def test_records_of_no_known_type_are_refused_and_counted():
    counter = ForgeryCounter()
    v = SwarmRecordValidator(counter=counter)
    rec = DHTRecord(KEY, MSGPackSerializer.dumps("other"), MSGPackSerializer.dumps({"x": 1}), time.time() + 5)
    assert not v.validate(rec) and counter.snapshot()["unknown"] == 1
