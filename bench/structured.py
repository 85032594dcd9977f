"""What structured outputs cost: the same prompts at the same concurrency, once free and once
under a 50-property JSON schema, alternated round by round on one server (A/B/A/B), as tok/s;
and how long that schema takes to compile and check (in the API process: llguidance's compile
plus the check against the model's tokenizer), cold and warm.

    .venv/bin/python bench/structured.py --start --concurrency 16 --rounds 4

Both workloads generate exactly `--output-tokens` tokens per request (`ignore_eos`; the schema
is too long to complete within them), so tok/s compares like with like. Run it alone on the
machine; the figures go to docs/benchmarks.md with the command, date and CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import httpx
from bench_serve import start_server

SCHEMA = {
    "type": "object",
    "properties": {f"field_{i:02d}": {"type": "string", "maxLength": 24} for i in range(50)},
    "required": [f"field_{i:02d}" for i in range(50)],
    "additionalProperties": False,
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def compile_seconds() -> tuple[float, float]:
    """The 50-property schema compiled and checked as the API does: cold (the tokenizer view
    built first) and warm (seconds)."""
    from probserve.api.plans.grammar import GrammarAsk, compile_grammar
    from probserve.engine.grammar import grammar_error, llguidance_tokenizer
    from probserve.models import load_tokenizer, prepared_source

    tok = load_tokenizer(prepared_source(None))
    start = time.perf_counter()
    lltok = llguidance_tokenizer(tok, len(tok), [tok.eos_token_id])
    ask = GrammarAsk("json_schema", "bench", SCHEMA)
    assert not grammar_error(compile_grammar(ask, 1 << 20, 1024), lltok)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(10):
        assert not grammar_error(compile_grammar(ask, 1 << 20, 1024), lltok)
    return cold, (time.perf_counter() - start) / 10


async def level(
    url: str, prompts: list[list[int]], args: argparse.Namespace, schema: bool
) -> float:
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=args.timeout) as client:

        async def one(p: list[int]) -> int:
            body: dict = {"model": args.model, "prompt": p, "max_tokens": args.output_tokens,
                          "temperature": 0, "ignore_eos": True}  # fmt: skip
            if schema:
                body["response_format"] = {
                    "type": "json_schema", "json_schema": {"name": "wide", "schema": SCHEMA}
                }  # fmt: skip
            async with sem:
                r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--start", action="store_true", help="start probserve serve for the run")
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32, help="per round and workload")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    cold, warm = compile_seconds()
    proc = None
    url = args.url or f"http://127.0.0.1:{args.port}"
    if args.start:
        proc = start_server(args.port, [])
    try:
        figures: dict[str, list[float]] = {"free": [], "schema": []}
        words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by"]
        for r in range(args.rounds):
            text = [" ".join(words[(i + r + j) % len(words)] for j in range(60))
                    for i in range(args.requests)]  # fmt: skip
            prompts = [httpx.post(f"{url}/tokenize", json={"prompt": t}).json()["tokens"]
                       for t in text]  # fmt: skip
            order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
            for name in order:
                tps = asyncio.run(level(url, prompts, args, name == "schema"))
                figures[name].append(round(tps, 1))
                print(f"round {r}: {name} {tps:.1f} tok/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    mean = {k: sum(v) / len(v) for k, v in figures.items()}
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, command: {' '.join(sys.argv)}")
    print(f"compile + check of the 50-property schema: cold {cold * 1000:.0f} ms (the tokenizer "
          f"view built first), warm {warm * 1000:.1f} ms")  # fmt: skip
    print(f"| {args.concurrency} streams | mean tok/s | rounds |\n|---|---:|---|")
    for k, v in figures.items():
        print(f"| {k} | {mean[k]:.1f} | {', '.join(map(str, v))} |")
    print(f"schema / free: {mean['schema'] / mean['free']:.3f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
