"""`swarm-node doctor`: check this machine before joining a swarm.

Each check prints one line, ``ok``, ``warn`` or ``FAIL``, with the fix when it is not ok:
torch and CUDA, free RAM/VRAM against what the manifest's stage needs, ports free, p2pd present
and runnable, clock sane, identity file permissions, and (with ``--initial-peers``) whether the
bootstrap peers are reachable and whether peers can dial this machine directly or only through a
relay (NAT). Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# the clock must be past this (project start); a clock far in the past breaks TLS/Noise handshakes
_EARLIEST_SANE = time.mktime((2026, 1, 1, 0, 0, 0, 0, 0, 0))


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", default="default", help="run manifest (path or shipped name)")
    p.add_argument("--stage", default="all", help="stage to check memory for: N or all (default all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--identity", default=None, help="identity key file to check")
    p.add_argument("--organiser", default="", metavar="FINGERPRINT",
                   help="the organiser key fingerprint `run --organiser` will pin: the manifest must be signed by it")
    p.add_argument("--metrics-port", type=int, default=9100, help="metrics port that must be free")
    p.add_argument("--port", type=int, action="append", default=[], help="another TCP port that must be free")
    p.add_argument("--initial-peers", nargs="*", default=[], help="bootstrap multiaddrs to test reachability")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds for the reachability check (default: %(default)s)")
    p.add_argument("--nat-wait", type=float, default=40.0,
                   help="seconds the NAT check waits for AutoNAT's verdict (0: skip it); it listens on the first "
                        "--port, so a forwarded port is tested (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def check_torch(device_spec: str) -> tuple[list[Check], str | None]:
    import torch

    from node.ops.resources import fmt_bytes, resolve_device

    checks = [Check("torch", "ok", f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        free, total = torch.cuda.mem_get_info()
        bf16 = torch.cuda.is_bf16_supported()
        checks.append(
            Check(
                "cuda",
                "ok" if bf16 else "warn",
                f"{len(names)} GPU(s): {', '.join(names)}; free {fmt_bytes(free)} of {fmt_bytes(total)}"
                + ("" if bf16 else "; no bf16 support: training runs in fp32"),
            )
        )
    else:
        checks.append(Check("cuda", "warn" if device_spec.startswith("cuda") else "ok",
                            "no CUDA device: the node will train on the CPU (slow but correct)"))
    try:
        device = resolve_device(device_spec)
    except ValueError as e:
        checks.append(Check("device", "fail", str(e)))
        return checks, None
    checks.append(Check("device", "ok", f"--device {device_spec} -> {device}"))
    return checks, device


def check_memory(manifest_arg: str, stage_arg: str, device: str, organiser: str = "") -> list[Check]:
    from node.ops.resources import available_device_bytes, estimate_stage_memory, fmt_bytes
    from stages import ManifestError, load_manifest

    try:
        m = load_manifest(manifest_arg)
    except ManifestError as e:
        return [Check("manifest", "fail", str(e))]
    out = [Check("manifest", "ok", f"run {m.run.id}: {m.n_stages} stages, d={m.model.d_model}, k={m.k}"),
           check_signature(m, organiser)]
    stages = range(m.n_stages) if stage_arg == "all" else [int(stage_arg)]
    free = available_device_bytes(device)
    for i in stages:
        if not 0 <= i < m.n_stages:
            out.append(Check(f"stage {i}", "fail", f"no stage {i}; the run has stages 0..{m.n_stages - 1}"))
            continue
        need = estimate_stage_memory(m, i)
        fits = need.total_bytes <= free
        out.append(
            Check(
                f"memory stage {i}",
                "ok" if fits else "fail",
                f"needs ~{fmt_bytes(need.total_bytes)} ({need.params:,} params), {device} has "
                f"{fmt_bytes(free)} free" + ("" if fits else "; pick another stage or a smaller batch"),
            )
        )
    return out


def check_signature(m, organiser: str = "") -> Check:
    """Whether `swarm-node run` will accept this manifest: signed by its organiser key (the pinned
    one, with ``organiser``), or unsigned (a swarm on this machine only, with --local
    --allow-unsigned)."""
    from security import manifest_signature_problem, organiser_fingerprint

    signer = organiser_fingerprint(m.run.organiser) if m.run.organiser else ""
    if organiser and signer != organiser:
        said = f"signed by organiser {signer}" if signer else "not signed"
        return Check("signature", "fail", f"{said}, not by the pinned organiser {organiser}: another run's manifest "
                                          "or a forgery; get the manifest from the run's organisers")
    if not m.run.organiser:
        return Check("signature", "warn", "unsigned: runs only on this machine (--local --allow-unsigned); "
                                          "a public run's organisers sign it with swarm-node manifest sign")
    problem = manifest_signature_problem(m)
    if problem is not None:
        return Check("signature", "fail", f"{problem}; get the signed manifest from the run's organisers")
    if organiser:
        return Check("signature", "ok", f"signed by organiser {signer}, the pinned one")
    return Check("signature", "ok", f"signed by organiser {signer}; pin it with run --organiser {signer}")


def check_port(port: int, what: str) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            return Check(f"port {port}", "fail", f"{what} port {port} is in use ({e.strerror}); "
                         f"stop the other process or choose another port")
    return Check(f"port {port}", "ok", f"{what} port {port} is free")


def p2pd_path() -> Path | None:
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "hivemind_cli" / "p2pd"


def check_p2pd() -> Check:
    path = p2pd_path()
    if path is None or not path.exists():
        return Check("p2pd", "fail", "p2pd not found: reinstall with `make setup` (it ships in the hivemind wheel)")
    if not os.access(path, os.X_OK):
        return Check("p2pd", "fail", f"{path} is not executable: chmod +x {path}")
    try:
        r = subprocess.run([str(path), "-h"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("p2pd", "fail", f"{path} does not run: {e}")
    text = r.stdout + r.stderr
    if "Usage" not in text and "-listen" not in text and "hostAddrs" not in text:
        return Check("p2pd", "fail", f"{path} -h printed nothing usable (exit {r.returncode})")
    return Check("p2pd", "ok", f"{path} runs")


def check_clock() -> Check:
    now = time.time()
    if now < _EARLIEST_SANE:
        return Check("clock", "fail", f"system clock reads {time.ctime(now)}; set the time (e.g. enable NTP)")
    mono_a, wall_a = time.monotonic(), time.time()
    time.sleep(0.05)
    drift = abs((time.time() - wall_a) - (time.monotonic() - mono_a))
    if drift > 0.5:
        return Check("clock", "warn", f"wall clock jumped {drift:.2f}s against the monotonic clock")
    return Check("clock", "ok", f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now))}")


def doctor_identity_check(path: str | None) -> Check:
    """``--identity`` as a doctor line: the file checks a node makes before it uses its key
    (``node.net.check_identity``), or a warning when there is none."""
    from node.base import CliError
    from node.net import check_identity

    if not path:
        return Check("identity", "warn", "no --identity given: a fresh identity is used each start; "
                     "create one with `swarm-node keygen KEYFILE`")
    try:
        peer_id = check_identity(path)
    except CliError as e:
        return Check("identity", "fail", str(e))
    mode = stat.S_IMODE(Path(path).stat().st_mode)
    return Check("identity", "ok", f"{path} mode {mode:04o}, peer id {peer_id}")


def check_reachability(peers: list[str], timeout: float) -> Check:
    """Bootstrap a throwaway DHT node from the given peers (in a child process, bounded)."""
    code = (
        "import sys, hivemind\n"
        "dht = hivemind.DHT(initial_peers=sys.argv[1:], start=True, client_mode=True,"
        " host_maddrs=['/ip4/0.0.0.0/tcp/0'])\n"
        "print(len(dht.get_visible_maddrs()))\n"
        "dht.shutdown()\n"
    )
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", code, *peers], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Check("reachability", "fail", f"no answer from {', '.join(peers)} within {timeout:.0f}s; "
                     "check the multiaddr, that the peer is up, and your firewall")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["unknown error"])[-1]
        return Check("reachability", "fail", f"could not bootstrap from {', '.join(peers)}: {last}")
    return Check("reachability", "ok", f"bootstrapped from {len(peers)} peer(s) in {time.perf_counter() - t0:.1f}s")


_NAT_PROBE = """
import asyncio, json, sys, time
from node.net import p2p_options, start_daemon

async def main(wait, port, peers):
    p2p = await start_daemon(host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], announce_maddrs=[], initial_peers=peers,
                             identity_path=None, startup_timeout=20, **p2p_options(False, peers))
    t0 = time.monotonic()
    try:
        while True:
            maddrs = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
            relayed = [m for m in maddrs if "/p2p-circuit" in m]
            if relayed or time.monotonic() - t0 > wait:
                break
            await asyncio.sleep(1.0)
        print(json.dumps({"relayed": relayed, "maddrs": maddrs, "seconds": round(time.monotonic() - t0, 1)}))
    finally:
        await p2p.shutdown()

asyncio.run(main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
"""


def check_nat(peers: list[str], wait: float = 40.0, port: int = 0) -> Check:
    """Whether other peers can dial this machine, or reach it only through a relay.

    A throwaway p2pd with the options `swarm-node run` uses (AutoNAT, auto-relay with the initial
    peers as relays) listens on ``port`` (0: any) and bootstraps from ``peers``. The peers' AutoNAT
    service dials it back; when nobody can (behind NAT, port not forwarded), p2pd reserves a slot
    at a relay and gets a ``/p2p-circuit`` address, within about 20 s in the network lab. No relay
    address within ``wait`` seconds means AutoNAT did not find this machine unreachable."""
    try:
        r = subprocess.run([sys.executable, "-c", _NAT_PROBE, str(wait), str(port), *peers], capture_output=True,
                           text=True, timeout=wait + 40)
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return Check("nat", "fail", f"the NAT check did not finish within {wait + 40:.0f} s")
    except (ValueError, IndexError):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return Check("nat", "fail", f"the NAT check failed: {last[:300]}")
    if found["relayed"]:
        relay = found["relayed"][0].split("/p2p-circuit")[0]
        return Check("nat", "warn",
                     f"reachable only through a relay ({relay}): peers cannot dial this machine (NAT or firewall; "
                     "AutoNAT found it private after %.0f s). It trains, with its traffic relayed; for direct "
                     "connections forward a TCP port to it and run with --host-maddrs /ip4/0.0.0.0/tcp/PORT "
                     "--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT" % found["seconds"])
    return Check("nat", "ok", f"reachable directly: in {found['seconds']:.0f} s AutoNAT did not find this machine "
                              "behind NAT and no relay was needed")


def run_checks(args: argparse.Namespace) -> list[Check]:
    from node.base import CliError
    from node.ops.config import check_fingerprint

    checks, device = check_torch(args.device)
    try:
        pin = check_fingerprint(args.organiser)
    except CliError as e:
        checks.append(Check("organiser", "fail", str(e)))
        pin = ""
    if device is not None:
        checks += check_memory(args.manifest, args.stage, device, pin)
    checks.append(check_port(args.metrics_port, "metrics"))
    for port in args.port:
        checks.append(check_port(port, "p2p"))
    checks.append(check_p2pd())
    checks.append(check_clock())
    checks.append(doctor_identity_check(args.identity))
    if args.initial_peers:
        checks.append(check_reachability(args.initial_peers, args.timeout))
        if checks[-1].status == "ok" and args.nat_wait > 0:
            checks.append(check_nat(args.initial_peers, args.nat_wait, args.port[0] if args.port else 0))
    return checks


def main(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"{c.status.upper():5s} {c.name:16s} {c.detail}")
    failed = [c for c in checks if c.status == "fail"]
    if not args.json:
        print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed" + (
            "" if not failed else f"; fix: {', '.join(c.name for c in failed)}"))
    return 1 if failed else 0
