"""What the API process spends while requests wait: one request holds the only batch slot
(`--max-num-seqs 1`, non-streaming, decoding for the whole measurement) and `--queued` more
non-streaming requests wait behind it; the API process's CPU time is read from /proc over
`--seconds`. Each tree (this one, and each `--tree LABEL=DIR`, as bench/race.py) runs in turn.

    .venv/bin/python bench/idle_queue.py --queued 1000 --tree before=/tmp/before

Run alone on the machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
from race import Server


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(url: str, pid: int, queued: int, seconds: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=queued + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        hog = {"prompt": "Count to ten thousand:", "max_tokens": 8000, "ignore_eos": True}
        body = {"prompt": "Hello", "max_tokens": 4}
        tasks = [asyncio.create_task(c.post("/v1/completions", json=hog))]
        await asyncio.sleep(1.0)
        tasks += [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(queued)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            health = (await c.get("/health")).json()
            if health.get("waiting", 0) >= queued:
                break
            await asyncio.sleep(0.5)
        waiting = health.get("waiting", 0)
        before, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        used, wall = cpu_seconds(pid) - before, time.monotonic() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"waiting": waiting, "api_cores": round(used / wall, 4)}


def run_tree(label: str, src: Path, args: argparse.Namespace, port: int) -> dict[str, float]:
    cmd = ["env", f"PYTHONPATH={src}", sys.executable, "-m", "probserve.cli", "serve", "--port",
           str(port), "--max-num-seqs", "1", "--max-queued", str(args.queued + 16),
           "--request-timeout", "0"]  # fmt: skip
    server = Server(label, cmd, port, "", Path(f"/tmp/idle-queue-{label}.log"))
    server.start()
    try:
        pid = server.proc.pid  # type: ignore[union-attr]  # the API process (`env` execs it)
        return asyncio.run(measure(server.url, pid, args.queued, args.seconds))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = [("now", here), *((t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree)]
    print(time.strftime("%Y-%m-%d"), "command:", " ".join(sys.argv))
    for i, (label, tree) in enumerate(trees):
        row = run_tree(label, tree.resolve() / "src", args, 8300 + i)
        print(f"{label}: {row['waiting']:.0f} waiting, API process {row['api_cores']:.3f} cores")


if __name__ == "__main__":
    main()
