"""`swarm-node doctor` reports real problems with the fix."""

from __future__ import annotations

import argparse
import socket

import pytest

from node.ops import doctor


def _args(**kw):
    p = argparse.ArgumentParser()
    doctor.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_healthy_machine(tmp_path):
    from node.net.identity import write_identity

    key = tmp_path / "id.key"
    peer_id = write_identity(key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    checks = _by_name(doctor.run_checks(_args(manifest="test", identity=str(key), metrics_port=free_port)))
    assert checks["p2pd"].status == "ok"
    assert checks["identity"].status == "ok" and peer_id in checks["identity"].detail
    assert checks["memory stage 0"].status == "ok"
    assert checks["clock"].status == "ok"


def test_doctor_flags_world_readable_key_port_in_use_and_bad_manifest(tmp_path):
    key = tmp_path / "id.key"
    key.write_bytes(b"x")
    key.chmod(0o644)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        checks = _by_name(doctor.run_checks(_args(manifest="test", identity=str(key), metrics_port=port)))
    assert checks["identity"].status == "fail"
    assert f"chmod 600 {key}" in checks["identity"].detail
    key.chmod(0o600)  # private, but not a key: the node would refuse it, and so does doctor
    assert "not a usable identity" in doctor.doctor_identity_check(str(key)).detail
    assert checks[f"port {port}"].status == "fail" and "in use" in checks[f"port {port}"].detail
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_heads = 7\n")
    checks = _by_name(doctor.run_checks(_args(manifest=str(bad))))
    assert checks["manifest"].status == "fail" and "model.n_heads" in checks["manifest"].detail


def test_doctor_memory_check_fails_when_stage_cannot_fit(monkeypatch):
    import node.ops.resources as res

    monkeypatch.setattr(res, "available_device_bytes", lambda device: 1024)
    checks = _by_name(doctor.run_checks(_args(manifest="test", stage="1")))
    assert checks["memory stage 1"].status == "fail"
    assert "needs ~" in checks["memory stage 1"].detail and "1.0 KiB free" in checks["memory stage 1"].detail


@pytest.mark.timeout(60)
def test_doctor_reports_unreachable_bootstrap():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
    check = doctor.check_reachability([maddr], timeout=30)
    assert check.status == "fail"
    assert maddr in check.detail


def test_doctor_reports_the_manifest_signature(tmp_path):
    from node.ops.manifest_cmd import sign_manifest
    from security import OrganiserKey
    from stages import load_manifest, manifest_toml

    signed = sign_manifest(load_manifest("test"), OrganiserKey.generate())
    good, bad = tmp_path / "run.toml", tmp_path / "bad.toml"
    good.write_text(manifest_toml(signed))
    bad.write_text(manifest_toml(signed).replace("seed = 7", "seed = 8"))
    assert _by_name(doctor.run_checks(_args(manifest="test")))["signature"].status == "warn"
    assert _by_name(doctor.run_checks(_args(manifest=str(good))))["signature"].status == "ok"
    check = _by_name(doctor.run_checks(_args(manifest=str(bad))))["signature"]
    assert check.status == "fail" and "does not verify" in check.detail
