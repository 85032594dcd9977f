"""Load and chaos test: many concurrent clients with random parameters and random disconnects.

Every request must end as completed (200 with a finish_reason / a stream ending in [DONE]),
errored (a 4xx or an error event, each with OpenAI's envelope) or cancelled (by the client on
purpose). Anything else (a 5xx, a malformed body, a stream cut without [DONE], a request still
open when the time bound passes) is lost, and the script exits 1. Loopback only; bounded in
count and time. Afterwards the server must be idle again (no request, no KV cache held).

    .venv/bin/python bench/load_test.py --start --requests 600 --concurrency 200
    .venv/bin/python bench/load_test.py --url http://127.0.0.1:8000 --requests 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx
from bench_serve import start_server  # type: ignore[import-not-found]

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fib(n):",
    "Water boils at",
    "List three colours:",
    "Translate to French: cheese",
]


def random_body(rng: random.Random, chat: bool) -> dict:
    body: dict = {
        "model": MODEL,
        "max_tokens": rng.choice([0, 1, 4, 16, 40]),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", [".", ","], "the"])
    if rng.random() < 0.1:
        body["top_p"] = rng.choice([0.5, 0.9])
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        body["max_tokens"] = max(1, body["max_tokens"])
        if rng.random() < 0.5:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 2, 5])
    else:
        body["prompt"] = rng.choice(PROMPTS)
        if rng.random() < 0.5:
            body["logprobs"] = rng.choice([0, 1, 5])
        if not body["stream"] and rng.random() < 0.2:
            body["echo"] = True
        if rng.random() < 0.1:
            body["n"] = 2
    if rng.random() < 0.08:  # a bad request: must be a clean 4xx
        body[rng.choice(["temperature", "max_tokens", "logprobs"])] = rng.choice([-5, "x", 10**9])
    return body


async def one(client: httpx.AsyncClient, rng: random.Random, timeout: float) -> str:
    chat = rng.random() < 0.4
    body = random_body(rng, chat)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    disconnect_after = rng.choice([None, None, None, 0, 1, 3])  # chunks, or leave early
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=timeout) as r:
                if r.status_code >= 500:
                    return "lost"
                if r.status_code != 200:
                    err = json.loads(await r.aread())
                    return "errored" if "error" in err else "lost"
                seen = 0
                last = ""
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    last = line
                    if '"error"' in line and line.startswith('data: {"error"'):
                        return "errored"
                    seen += 1
                    if disconnect_after is not None and seen > disconnect_after:
                        return "cancelled"
                return "completed" if last == "data: [DONE]" else "lost"
        if disconnect_after is not None and rng.random() < 0.5:
            try:
                await client.post(path, json=body, timeout=0.05 + rng.random() * 0.3)
            except httpx.TimeoutException:
                return "cancelled"
            return "completed"
        r = await client.post(path, json=body, timeout=timeout)
        if r.status_code >= 500:
            return "lost"
        data = r.json()
        if r.status_code != 200:
            return "errored" if "error" in data else "lost"
        ok = all(c.get("finish_reason") in ("stop", "length") for c in data["choices"])
        return "completed" if ok else "lost"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        return "lost"


async def run(url: str, requests: int, concurrency: int, seconds: float, seed: int) -> Counter:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def guarded(i: int) -> str:
            async with sem:
                return await one(client, random.Random(rng.random() + i), seconds)

        tasks = [asyncio.ensure_future(guarded(i)) for i in range(requests)]
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        for t in pending:
            t.cancel()
        counts = Counter(t.result() for t in done)
        counts["lost"] += len(pending)  # still open when the bound passed: hung
    return counts


async def wait_idle(url: str, seconds: float = 30) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        deadline = time.monotonic() + seconds
        while True:
            h = (await c.get("/health")).json()
            idle = h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0
            if idle or time.monotonic() > deadline:
                return h
            await asyncio.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default=None)
    ap.add_argument("--start", action="store_true", help="start probserve serve for the run")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=600, help="bound for the whole run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    proc = start_server(args.port, []) if args.start else None
    url = f"http://127.0.0.1:{args.port}" if args.start else args.url
    if url is None:
        raise SystemExit("give --url or --start")
    try:
        started = time.monotonic()
        counts = asyncio.run(run(url, args.requests, args.concurrency, args.seconds, args.seed))
        health = asyncio.run(wait_idle(url))
        elapsed = time.monotonic() - started
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report = {k: counts.get(k, 0) for k in ("completed", "errored", "cancelled", "lost")}
    print(
        json.dumps(
            {
                **report,
                "requests": args.requests,
                "seconds": round(elapsed, 1),
                "server_after": health,
            }
        )
    )
    idle = health["running"] == health["waiting"] == health["held_caches"] == 0
    return 0 if report["lost"] == 0 and idle else 1


if __name__ == "__main__":
    sys.exit(main())
