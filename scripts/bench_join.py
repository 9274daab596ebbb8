"""Benchmark: what verifying a joiner's downloaded state costs. A local swarm of the default run
(bootstrap, head, two replicas of the middle stage, tail; separate processes on loopback) trains;
then a new replica of the middle stage joins, alternately with state verification (the default:
download from up to three replicas, compare them in parameter space) and without
(``--no-verify-state``: one replica's state taken as it is). Prints ONE JSON object:

    join_s (median seconds from the joiner's start to its "online" line, per mode), download_s
    (median of the node's own download-and-check time, from its log), ratio_join and
    ratio_download (verified / unverified), per-run lists, settings.

    .venv/bin/python scripts/bench_join.py [--joins 2] [--manifest default] [--warm-steps 20]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default="default")
    ap.add_argument("--joins", type=int, default=2, help="joins per mode (alternating)")
    ap.add_argument("--warm-steps", type=int, default=20, help="tail steps before the first join")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()

    from node.ops import LocalSwarm

    runs = {"verified": [], "unverified": []}
    downloads = {"verified": [], "unverified": []}
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmp:
        sw = LocalSwarm(args.manifest, workdir=Path(tmp) / "swarm")
        try:
            sw.start_bootstrap()
            nodes = [sw.start_node(0, name="head"), sw.start_node(1, name="mid-a"), sw.start_node(1, name="mid-b"),
                     sw.start_node(2, name="tail")]
            sw.wait_ready(timeout=args.timeout)
            deadline = time.monotonic() + args.timeout
            while sw.value(nodes[-1], "swarm_node_steps_total") < args.warm_steps and time.monotonic() < deadline:
                time.sleep(0.5)
            for i in range(2 * args.joins):
                mode = "verified" if i % 2 == 0 else "unverified"
                extra = [] if mode == "verified" else ["--no-verify-state"]
                t0 = time.monotonic()
                joiner = sw.start_node(1, name=f"join-{i}-{mode}", extra=extra)
                while "online:" not in joiner.output() and time.monotonic() - t0 < args.timeout:
                    if joiner.proc.poll() is not None:
                        raise RuntimeError(f"the joiner exited: {joiner.logs()[-2000:]}")
                    time.sleep(0.1)
                runs[mode].append(round(time.monotonic() - t0, 2))
                m = re.search(r"state ready in ([0-9.]+) s", joiner.logs())
                if m:
                    downloads[mode].append(float(m.group(1)))
                sw.stop(joiner, timeout=30)
        finally:
            sw.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    dmed = {k: statistics.median(v) if v else None for k, v in downloads.items()}
    out = {
        "join_s": med, "download_s": dmed,
        "ratio_join": round(med["verified"] / med["unverified"], 3),
        "ratio_download": (round(dmed["verified"] / dmed["unverified"], 3)
                           if dmed["verified"] and dmed["unverified"] else None),
        "runs": runs, "downloads": downloads,
        "settings": {"manifest": args.manifest, "joins_per_mode": args.joins, "replicas_online": 2,
                     "warm_steps": args.warm_steps},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
