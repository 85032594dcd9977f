"""Throughput benchmark: streaming completions against an OpenAI-compatible server.

Fixed prompt and output lengths (prompts of random common words, sent as token ids; outputs
generated with ignore_eos), a concurrency sweep, logprobs on or off, and a scoring workload
(echo + max_tokens 1, as lm-evaluation-harness sends). Loopback only; every request loop is
bounded in count and time.

    .venv/bin/python bench/bench_serve.py --start --concurrency 1 4 16 32
    .venv/bin/python bench/bench_serve.py --url http://127.0.0.1:8001 --model smollm2  # a peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import zlib
from array import array
from dataclasses import dataclass

import httpx

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "people",
    "time",
    "year",
    "day",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "house",
    "water",
    "city",
    "money",
    "story",
    "music",
    "river",
    "market",
    "school",
    "family",
    "friend",
    "question",
    "answer",
    "morning",
    "evening",
    "garden",
    "window",
    "table",
    "light",
]


@dataclass
class Result:
    tokens: int
    seconds: float
    ok: bool
    ttft: float | None = None  # seconds to the first token


def _texts(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length * 2)) for _ in range(n)]


def make_prompts(client: httpx.Client, n: int, length: int, seed: int) -> list[list[int]]:
    """Token-id prompts of `length` tokens, tokenized by a server's /tokenize."""
    prompts = []
    for text in _texts(n, length, seed):
        ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        prompts.append(ids.json()["tokens"][:length])
    return prompts


def make_prompts_local(tokenizer: object, n: int, length: int, seed: int) -> list[list[int]]:
    """The same prompts as `make_prompts`, tokenized here (every peer gets the same ids)."""
    return [
        tokenizer(text, add_special_tokens=False)["input_ids"][:length]  # type: ignore[operator]
        for text in _texts(n, length, seed)
    ]


async def one_stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    out_tokens: int,
    logprobs: int | None,
    timeout: float,
    temperature: float = 0.0,
) -> Result:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": temperature,
        # the count of tokens from the server's own usage: a chunk may carry several (speculation)
        "stream_options": {"include_usage": True},
    }
    if temperature > 0:  # sampled: a seed of the prompt's own, the same text on every server run
        body["seed"] = zlib.crc32(array("q", prompt).tobytes())
    if logprobs is not None:
        body["logprobs"] = logprobs
    start = time.perf_counter()
    tokens = 0
    reported: int | None = None  # the final chunk's usage, where the server sends it
    ttft = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    reported = int(usage["completion_tokens"])
                for choice in chunk.get("choices", []):
                    lp = choice.get("logprobs")
                    # OpenAI's completions shape {"tokens": [...]}; llama-server sends chat's
                    # {"content": [...]} on completions too
                    counted = (lp.get("tokens") or lp.get("content") or []) if lp else []
                    tokens += len(counted) if lp else (1 if choice.get("text") else 0)
                if tokens and ttft is None:
                    ttft = time.perf_counter() - start
        tokens = reported if reported is not None else tokens
        return Result(tokens, time.perf_counter() - start, r.status_code == 200, ttft)
    except (TimeoutError, httpx.HTTPError):
        return Result(tokens, time.perf_counter() - start, False, ttft)


async def run_level(
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    out_tokens: int,
    logprobs: int | None,
    timeout: float,
    temperature: float = 0.0,
) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def guarded(p: list[int]) -> Result:
            async with sem:
                return await one_stream(
                    client, model, p, out_tokens, logprobs, timeout, temperature
                )

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start
    toks = sum(r.tokens for r in results)
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": sum(r.ok for r in results),
        "output_tokens": toks,
        "seconds": round(wall, 2),
        "tok_per_s": round(toks / wall, 1),
        "ttft_p50": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
    }


async def run_scoring(
    url: str, model: str, prompts: list[list[int]], concurrency: int, timeout: float
) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:

        async def score(p: list[int]) -> int:
            async with sem:
                body = {
                    "model": model,
                    "prompt": p,
                    "max_tokens": 1,
                    "echo": True,
                    "logprobs": 1,
                    "temperature": 0,
                }
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                return len(p)

        start = time.perf_counter()
        counts = await asyncio.gather(*(score(p) for p in prompts))
        wall = time.perf_counter() - start
    return {
        "workload": "scoring",
        "requests": len(counts),
        "prompt_tokens": sum(counts),
        "seconds": round(wall, 2),
        "prompt_tok_per_s": round(sum(counts) / wall, 1),
    }


def mc_prompts(prompts: list[list[int]], choices: int, cont_len: int, seed: int) -> list:
    """lm-eval multiple-choice shape: one context, several continuations each."""
    rng = random.Random(seed)
    out = []
    for ctx in prompts:
        for _ in range(choices):
            out.append(ctx + [rng.randrange(1000, 20000) for _ in range(cont_len)])
    return out


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "probserve")
    proc = subprocess.Popen([exe, "serve", "--port", str(port), "--log-level", "warning", *extra])
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default=None, help="an already running server")
    ap.add_argument("--start", action="store_true", help="start probserve serve for the run")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--server-args", default="", help="extra args for probserve serve")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokenizer-url", default=None, help="server whose /tokenize builds prompts")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--scoring", action="store_true", help="also run the scoring workloads")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()

    proc = None
    url = args.url
    if args.start:
        proc = start_server(args.port, args.server_args.split())
        url = f"http://127.0.0.1:{args.port}"
    if url is None:
        raise SystemExit("give --url or --start")
    try:
        with httpx.Client(base_url=args.tokenizer_url or url, timeout=60) as c:
            pool = make_prompts(
                c, max(args.concurrency) * args.requests_per_stream, args.prompt_tokens, seed=0
            )
        rows = []
        for conc in args.concurrency:
            prompts = pool[: conc * args.requests_per_stream]
            row = asyncio.run(
                run_level(
                    url, args.model, prompts, conc, args.output_tokens, args.logprobs, args.timeout
                )
            )
            row["logprobs"] = args.logprobs
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.scoring:
            # fresh prompts (other seeds): nothing of them is in the prefix cache yet
            with httpx.Client(base_url=args.tokenizer_url or url, timeout=60) as c:
                unrelated = make_prompts(c, 64, args.prompt_tokens, seed=1)
                contexts = make_prompts(c, 16, args.prompt_tokens, seed=2)
            row = asyncio.run(run_scoring(url, args.model, unrelated, 8, args.timeout))
            print(json.dumps(row), flush=True)
            mc = mc_prompts(contexts, choices=4, cont_len=5, seed=1)
            row = asyncio.run(run_scoring(url, args.model, mc, 8, args.timeout))
            row["workload"] = "scoring-multiple-choice (4 continuations per context)"
            print(json.dumps(row), flush=True)
        print("\n| concurrency | requests | ok | output tok/s |")
        print("|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['requests']} | {r['ok']} | {r['tok_per_s']} |")
    finally:
        if proc is not None:
            with open(f"/proc/{proc.pid}/status") as f:
                peak = next(line for line in f if line.startswith("VmHWM"))
            print(f"server peak RSS: {peak.split(':')[1].strip()}")
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
