"""node/ops/config.py: flags > SWARM_NODE_* env > TOML file > defaults, typed, with clear errors."""

from __future__ import annotations

import argparse

import pytest

from node.base import CliError
from node.ops.config import NodeConfig, add_arguments, load_config_file, resolve_config, tcp_ports


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_defaults_when_nothing_is_set():
    cfg = resolve_config(parse([]), env={})
    assert cfg == NodeConfig()
    assert cfg.stage == "auto" and cfg.stage_index() is None
    assert cfg.metrics_port == 9100 and cfg.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('metrics_port = 9200\nqueue_size = 3\nstage = 1\ncheckpoint_dir = "/from/file"\n'
                 'initial_peers = ["/ip4/10.0.0.1/tcp/1/p2p/QmA"]\n')
    env = {"SWARM_NODE_METRICS_PORT": "9300", "SWARM_NODE_QUEUE_SIZE": "5", "SWARM_NODE_CONFIG": str(f)}
    cfg = resolve_config(parse(["--metrics-port", "9400"]), env=env)
    assert cfg.metrics_port == 9400  # flag beats env and file
    assert cfg.queue_size == 5  # env beats file
    assert cfg.checkpoint_dir == "/from/file"  # file beats default
    assert cfg.stage == "1" and cfg.stage_index() == 1  # integers in the file are fine for stage
    assert cfg.initial_peers == ["/ip4/10.0.0.1/tcp/1/p2p/QmA"]
    assert cfg.drain_timeout == NodeConfig().drain_timeout  # untouched -> default


def test_config_flag_beats_env_config_path(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("queue_size = 2\n")
    b.write_text("[node]\nqueue_size = 7\n")  # a [node] table is accepted too
    cfg = resolve_config(parse(["--config", str(b)]), env={"SWARM_NODE_CONFIG": str(a)})
    assert cfg.queue_size == 7


def test_env_types_lists_and_bools():
    env = {
        "SWARM_NODE_INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/QmA, /ip4/5.6.7.8/tcp/2/p2p/QmB",
        "SWARM_NODE_LOCAL": "yes",
        "SWARM_NODE_PEER_LABELS": "0",
        "SWARM_NODE_CONTEXT_TTL": "2.5",
    }
    cfg = resolve_config(parse([]), env=env)
    assert cfg.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/5.6.7.8/tcp/2/p2p/QmB"]
    assert cfg.local is True and cfg.peer_labels is False and cfg.context_ttl == 2.5
    # --local turns the wildcard listen address into loopback
    assert cfg.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]


def test_boolean_flags_override_env_both_ways():
    assert resolve_config(parse(["--no-local"]), env={"SWARM_NODE_LOCAL": "1"}).local is False
    assert resolve_config(parse(["--averaging"]), env={"SWARM_NODE_AVERAGING": "false"}).averaging is True


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        ([], {"SWARM_NODE_METRICS_PORT": "abc"}, "SWARM_NODE_METRICS_PORT: expected an integer"),
        (["--metrics-port", "70000"], {}, "--metrics-port: expected 0..65535"),
        (["--stage", "head"], {}, "--stage: expected 'auto' or a stage index"),
        (["--queue-size", "0"], {}, "--queue-size: must be positive"),
        (["--drain-timeout", "-1"], {}, "--drain-timeout: must be > 0"),
        ([], {"SWARM_NODE_LOCAL": "maybe"}, "SWARM_NODE_LOCAL: expected true/false"),
        (["--initial-peers", "1.2.3.4:31337"], {}, "must start with '/'"),
        (["--data-shard", "16"], {}, "--data-shard: 16 is not below --num-shards 16"),
        # --allow-unsigned: every address the node listens on, announces or dials is loopback
        (["--local", "--allow-unsigned", "--initial-peers", "/ip4/203.0.113.7/tcp/31337/p2p/QmA"], {},
         "/ip4/203.0.113.7/tcp/31337/p2p/QmA is not a loopback address"),
        (["--allow-unsigned", "--host-maddrs", "/ip4/0.0.0.0/tcp/0"], {}, "/ip4/0.0.0.0/tcp/0 is not a loopback"),
        (["--local", "--allow-unsigned", "--announce-maddrs", "/ip4/127.0.0.1/tcp/1"], {}, "no --announce-maddrs"),
        (["--organiser", "not-hex-at-all!"], {}, "an organiser fingerprint is 16 hex digits"),
        (["--organiser", "abcdef"], {}, "an organiser fingerprint is 16 hex digits"),
    ],
)
def test_bad_values_name_the_source(argv, env, needle):
    with pytest.raises(CliError, match=None) as e:
        resolve_config(parse(argv), env=env)
    assert needle in str(e.value)


def test_config_file_errors_are_specific(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(CliError, match="no such file"):
        load_config_file(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("queue_size = \n")
    with pytest.raises(CliError, match="not valid TOML"):
        load_config_file(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("queue_sise = 3\n")
    with pytest.raises(CliError, match="unknown key 'queue_sise'"):
        load_config_file(typo)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('queue_size = "three"\n')
    with pytest.raises(CliError, match="queue_size: expected an integer"):
        load_config_file(wrong)


def test_tcp_ports_of_multiaddrs():
    assert tcp_ports(["/ip4/0.0.0.0/tcp/31337", "/ip4/127.0.0.1/tcp/0", "/ip6/::/tcp/4001/p2p/QmX"]) == [
        ("0.0.0.0", 31337), ("::", 4001)]
    with pytest.raises(CliError, match="not a number"):
        tcp_ports(["/ip4/1.2.3.4/tcp/http"])


def test_run_subcommand_exposes_every_field():
    from node.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for name in NodeConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in help_text


def test_every_setting_is_documented():
    from pathlib import Path

    from node.ops.config import env_name

    doc = (Path(__file__).resolve().parent.parent / "docs" / "NODE.md").read_text()
    for name in NodeConfig.__dataclass_fields__:
        assert f"`--{name.replace('_', '-')}`" in doc, name
        assert f"`{env_name(name)}`" in doc, name


def test_allow_unsigned_with_every_address_on_loopback_and_a_pin_normalised():
    cfg = resolve_config(parse(["--local", "--allow-unsigned", "--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/QmA",
                                "--organiser", "0123456789ABCDEF"]), env={})
    assert cfg.allow_unsigned and cfg.organiser == "0123456789abcdef"


def test_a_pinned_organiser_refuses_every_other_manifest():
    """``--organiser``: a manifest file names its own organiser key, so a stranger's manifest, signed
    with the stranger's key, is refused only by a pin the operator got from the organisers."""
    from node.ops.manifest_cmd import sign_manifest
    from node.ops.startup import check_signed
    from security import OrganiserKey, organiser_fingerprint
    from stages import load_manifest

    ours, theirs = OrganiserKey.generate(), OrganiserKey.generate()
    good, forged = (sign_manifest(load_manifest("test"), k) for k in (ours, theirs))
    pin = organiser_fingerprint(good.run.organiser)
    check_signed(good, "RUN.toml", allow_unsigned=False, organiser=pin)
    check_signed(forged, "RUN.toml", allow_unsigned=False)  # without a pin: signed by its own key, accepted
    with pytest.raises(CliError) as e:
        check_signed(forged, "RUN.toml", allow_unsigned=False, organiser=pin)
    assert f"signed by organiser {organiser_fingerprint(forged.run.organiser)}, not by the pinned" in str(e.value)
    with pytest.raises(CliError, match="is not signed, not by the pinned --organiser"):
        check_signed(load_manifest("test"), "test", allow_unsigned=True, organiser=pin)


def test_doctor_shows_the_organiser_and_checks_a_pin():
    from node.ops.doctor import check_signature
    from node.ops.manifest_cmd import sign_manifest
    from security import OrganiserKey, organiser_fingerprint
    from stages import load_manifest

    m = sign_manifest(load_manifest("test"), OrganiserKey.generate())
    f = organiser_fingerprint(m.run.organiser)
    c = check_signature(m)
    assert c.status == "ok" and f"signed by organiser {f}; pin it with run --organiser {f}" in c.detail
    c = check_signature(m, f)
    assert c.status == "ok" and "the pinned one" in c.detail
    c = check_signature(m, "0" * 16)
    assert c.status == "fail" and f"signed by organiser {f}, not by the pinned organiser {'0' * 16}" in c.detail


@pytest.mark.parametrize("argv, needle", [
    # an unsigned manifest on a public address: refused as `run` refuses it
    (["--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--manifest", "test"], "--manifest test is not signed"),
    # --allow-unsigned only where every address is loopback and none is announced
    (["--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--manifest", "test", "--allow-unsigned"],
     "--allow-unsigned is for a swarm on this machine only, but /ip4/0.0.0.0/tcp/0"),
    (["--local", "--manifest", "test", "--allow-unsigned", "--announce-maddrs", "/ip4/203.0.113.7/tcp/31337"],
     "/ip4/203.0.113.7/tcp/31337 is not a loopback address"),
])
def test_bootstrap_publishes_an_unsigned_manifest_only_as_run_would_use_one(argv, needle):
    from node.ops.bootstrap import _main, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(CliError) as e:  # refused before any daemon starts
        _main(parser.parse_args(argv))
    assert needle in str(e.value) and "\n" not in str(e.value)
