"""What speculative decoding (prompt lookup) costs where it cannot help: the engine alone (no
HTTP: the API's part is the same for both settings, the same tokens out), `--speculative off`
and `ngram` alternated in one process, on the race's token-id prompts with completions sampled
at a temperature (a seed each, of its prompt: the same text with and without, since speculation
changes no bit), so its guesses mostly miss. Per streams level: each run's seconds, steps,
proposed and kept tokens; at one stream also the median step with and without a proposal.

    .venv/bin/python bench/spec_cost.py --streams 1 16 32 --runs 3
    .venv/bin/python bench/spec_cost.py --streams 1 2 4 16 --runs 5 --mode auto   # the default

Run it alone on the machine (docs/benchmarks.md: "Prompt lookup by default").
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from array import array

from bench_serve import make_prompts_local

from probserve.engine import EngineConfig, EngineCore, EngineRequest, SamplingParams
from probserve.engine.core.host import configure_threads
from probserve.models import LoadedModel, load_model


def run(loaded: LoadedModel, prompts: list[list[int]], mode: str, args: argparse.Namespace) -> dict:
    """The prompts decoded together under `mode`: seconds, steps, proposed, kept; each step's
    time and whether a proposal was checked in it."""
    config = EngineConfig(deterministic=True, kv_cache_gib=1.0, speculative=mode)  # type: ignore[arg-type]
    core = EngineCore(loaded, config)
    core.warmup()
    for i, p in enumerate(prompts):
        seed = zlib.crc32(array("q", p).tobytes())
        params = SamplingParams(
            temperature=args.temperature, seed=seed, max_tokens=args.output_tokens, ignore_eos=True
        )
        core.add_request(EngineRequest(f"r{i}", tuple(p), params))
    spec = core.speculator
    plain: list[float] = []
    checked: list[float] = []
    start = time.perf_counter()
    while core.has_work():
        drafted = spec.drafted if spec else 0
        t = time.perf_counter()
        core.step()
        (checked if spec and spec.drafted != drafted else plain).append(time.perf_counter() - t)
    return {
        "seconds": round(time.perf_counter() - start, 3),
        "steps": len(plain) + len(checked),
        "proposed": spec.drafted if spec else 0,
        "kept": spec.accepted if spec else 0,
        "plain_step_ms": round(1e3 * statistics.median(plain), 2) if plain else None,
        "checking_step_ms": round(1e3 * statistics.median(checked), 2) if checked else None,
        "checking_steps": len(checked),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model spec (default: the embedded model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--runs", type=int, default=3, help="of each setting, alternated")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--mode",
        default="ngram",
        choices=["ngram", "auto"],
        help="the setting raced against off (auto: prompt lookup while few run)",
    )
    args = ap.parse_args()
    configure_threads(0)
    loaded = load_model(args.model, "native")
    for streams in args.streams:
        prompts = make_prompts_local(loaded.tokenizer, streams, args.prompt_tokens, seed=0)
        on = args.mode
        times: dict[str, list[float]] = {"off": [], on: []}
        for r in range(args.runs):  # off on, then on off: neither always first
            for mode in ("off", on) if r % 2 == 0 else (on, "off"):
                row = run(loaded, prompts, mode, args)
                times[mode].append(row["seconds"])
                print(f"{streams} streams, {mode}:", row, flush=True)
        off, spec = statistics.mean(times["off"]), statistics.mean(times[on])
        mid_off, mid_on = statistics.median(times["off"]), statistics.median(times[on])
        print(f"{streams} streams: off {off:.3f} s, {on} {spec:.3f} s (means of {args.runs}; "
              f"medians {mid_off:.3f} s, {mid_on:.3f} s): "
              f"{on} costs {100 * (spec / off - 1):.1f}%", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
