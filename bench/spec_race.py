"""Speculative decoding's same-run race: one stream, real text from the embedded model, on the
workloads speculation is meant for and on free text, probserve with `--speculative off` and
`--speculative MODE` (`--mode`: `auto`, the default, which at one stream proposes as `ngram`
does, or `ngram`) against llama-server without and with its own n-gram speculation
(`--spec-type`), each server alone on the machine in turn.

Workloads (chat completions, greedy, the model's chat template):
- edit: the model is asked to copy a ~180-word passage with one word changed (the reply repeats
  the prompt's text: what prompt lookup is for);
- json: the same passage's facts extracted under a JSON schema with fixed keys (structured
  outputs: probserve proposes the tokens a grammar forces, then prompt lookup's);
- free: an open question (the standard race's kind of text; speculation must not slow it).

    .venv/bin/python bench/spec_race.py [--rounds 3] [--mode auto] [--llama-spec ngram-simple]

probserve's answers with and without speculation are checked to be the same tokens (the
contract: docs/logprobs.md). Run it alone on the machine; the figures go to docs/benchmarks.md
with the command, date and CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from race import PEERS, Server, cpu_model

PASSAGE = (
    "The old lighthouse stood on a rocky point at the northern end of the island. For more "
    "than a hundred years its keepers had climbed the spiral stairs every evening to light the "
    "lamp, and every morning to put it out again. The last keeper, a quiet man named Thomas "
    "Reed, lived there with his cat, a grey tabby who slept on the warm stones beside the "
    "stove. In winter the storms came from the west, and the waves broke so high that the "
    "spray reached the windows of the lamp room. Thomas kept a logbook of every ship that "
    "passed, writing down its name, its flag and the time it went by. When the lighthouse was "
    "finally automated in 1987, he moved to a small house in the village, but he still walked "
    "to the point every evening to watch the light come on by itself. The cat went with him, "
    "and the villagers said that the two of them never missed a single night."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "keeper_name": {"type": "string"},
        "pet": {"type": "string"},
        "automated_year": {"type": "integer"},
        "location": {"type": "string"},
        "logbook_fields": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["keeper_name", "pet", "automated_year", "location", "logbook_fields"],
    "additionalProperties": False,
}
WORKLOADS = {
    "edit": {
        "messages": [{"role": "user", "content": "Copy the following text exactly, but write "
                      "'dog' instead of 'cat':\n\n" + PASSAGE}],
        "max_tokens": 220,
    },
    "json": {
        "messages": [{"role": "user", "content": "Extract the facts of this text as JSON:\n\n"
                      + PASSAGE}],
        "max_tokens": 120,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "facts", "schema": SCHEMA, "strict": True}},
    },
    "free": {
        "messages": [{"role": "user", "content": "Why do lighthouses use lenses? Explain "
                      "in a few paragraphs."}],
        "max_tokens": 160,
    },
}  # fmt: skip


def run(server: Server, model: str, rounds: int) -> dict[str, dict]:
    """Each workload `rounds` times, one request at a time: output tok/s over all rounds, and
    the first round's reply text."""
    out: dict[str, dict] = {}
    with httpx.Client(base_url=server.url, timeout=600) as client:
        body0 = {"model": model, **WORKLOADS["free"], "max_tokens": 8, "temperature": 0}
        client.post("/v1/chat/completions", json=body0)  # warm up
        for name, work in WORKLOADS.items():
            tokens, seconds, text = 0, 0.0, None
            for _ in range(rounds):
                body = {"model": model, **work, "temperature": 0}
                start = time.monotonic()
                r = client.post("/v1/chat/completions", json=body)
                seconds += time.monotonic() - start
                r.raise_for_status()
                answer = r.json()
                tokens += answer["usage"]["completion_tokens"]
                text = text if text is not None else answer["choices"][0]["message"]["content"]
            out[name] = {"tok_per_s": tokens / seconds, "tokens": tokens, "text": text}
            print(f"{server.name} {name}: {tokens / seconds:.1f} tok/s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "ngram"],
        help="probserve's --speculative against off (auto: the default)",
    )
    ap.add_argument("--llama-spec", default="ngram-simple", help="llama-server's --spec-type")
    ap.add_argument("--logs", default="/tmp/spec_race")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    exe = str(Path(sys.executable).parent / "probserve")
    binary = subprocess.run(["bash", str(PEERS / "llama_server.sh")], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    model_dir = subprocess.run(["bash", str(PEERS / "model.sh")], capture_output=True, text=True,
                               check=True).stdout.strip()  # fmt: skip
    llama = [binary, "-m", f"{model_dir}/model.gguf", "--host", "127.0.0.1", "--port", "8013",
             "-np", "4", "-c", "8192", "-t", "2", "--no-repack", "--jinja"]  # fmt: skip
    servers = [
        Server(f"probserve ({mode})", [exe, "serve", "--port", str(8020 + i), "--log-level",
               "warning", "--speculative", mode], 8020 + i, "smollm2-135m-instruct",
               logs / f"probserve-{mode}.log")
        for i, mode in enumerate(("off", args.mode))
    ]  # fmt: skip
    servers.append(Server("llama-server", llama, 8013, "smollm2", logs / "llama.log"))
    servers.append(Server(f"llama-server ({args.llama_spec})",
                          [*llama, "--spec-type", args.llama_spec], 8013, "smollm2",
                          logs / "llama-spec.log"))  # fmt: skip
    results: dict[str, dict] = {}
    for server in servers:
        print(f"== {server.name}: starting", flush=True)
        server.start()
        try:
            results[server.name] = run(server, server.model, args.rounds)
        finally:
            server.stop()
    off, on = results["probserve (off)"], results[f"probserve ({args.mode})"]
    same = {w: off[w]["text"] == on[w]["text"] for w in WORKLOADS}
    names = list(results)
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, {args.rounds} rounds a workload")
    print(
        "| workload | " + " | ".join(names) + f" | {args.mode} / off | {args.mode} / llama-spec |"
    )
    print("|---|" + "---:|" * (len(names) + 2))
    llama_spec = names[-1]
    for w in WORKLOADS:
        row = [f"{results[n][w]['tok_per_s']:.1f}" for n in names]
        ratio = on[w]["tok_per_s"] / off[w]["tok_per_s"]
        peer = on[w]["tok_per_s"] / results[llama_spec][w]["tok_per_s"]
        print(f"| {w} | " + " | ".join(row) + f" | {ratio:.2f}x | {peer:.2f}x |")
    print("probserve's replies the same with and without speculation:", json.dumps(same))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
