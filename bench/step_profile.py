"""Where a decode step's time goes: the engine alone (no HTTP), `--streams` greedy requests
decoding together, sampled with `perf` while they decode, the samples grouped into matrix
products, attention, a mixture of experts' routing, the other kernels (norms, activations, RoPE,
logprob rows) and everything else (Python, torch's small operations, OpenMP's waits).

    .venv/bin/python bench/step_profile.py                      # the embedded model, one stream
    .venv/bin/python bench/step_profile.py --model tinyshape-q4_0.gguf --streams 1 16
    .venv/bin/python bench/step_profile.py --op-by-op           # the layers called from Python
    .venv/bin/python bench/step_profile.py --model shapemoe-q4_k_m.gguf --products limbs
    .venv/bin/python bench/step_profile.py --scoring 8          # echo scoring, 8 prompts in flight
    .venv/bin/python bench/step_profile.py --scoring 32 --prompt-tokens 20
    .venv/bin/python bench/step_profile.py --model shapeq35-q4_k_m.gguf --prefill 4000

Needs `perf` (linux-perf); run alone on the machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

GROUPS = [
    ("matrix", re.compile(r"qmicro|micro<|qlinear|ps_linear|dequant_panel|ps_qlinear|limb")),
    ("routing", re.compile(r"ps_route")),
    ("attention", re.compile(r"ps_attention|scores_fast|pv_fast")),
    (
        "other kernels",
        re.compile(r"ps_rms_norm|glu|ps_silu|ps_gelu|ps_rope|ps_score|ps_topk|ps_entropy|ps_log_"),
    ),
    ("openmp", re.compile(r"gomp|GOMP|omp_")),
]


def record(seconds: float, out: str) -> None:
    """perf samples of this process for `seconds`, into `out`."""
    subprocess.run(
        ["perf", "record", "-q", "-F", "2000", "-p", str(os.getpid()), "-o", out, "--",
         "sleep", str(seconds)],
        check=True, capture_output=True,
    )  # fmt: skip


def shares(out: str, show: int = 0) -> dict[str, float]:
    """The stepping thread's samples in a recording, by group (fractions of its samples: of
    its wall time while it runs; the OpenMP team's other threads work or wait beside it); prints
    the `show` largest symbols."""
    report = subprocess.run(
        ["perf", "report", "-i", out, "--no-children", "--sort", "symbol", "--stdio", "-q",
         "--tid", str(threading.get_native_id())],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    share: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.*)", line)
        if not m:
            continue
        pct, symbol = float(m.group(1)) / 100, m.group(2).strip()
        if show > 0:
            print(f"    {pct:6.1%}  {symbol[:90]}")
            show -= 1
        group = next((name for name, rx in GROUPS if rx.search(symbol)), "everything else")
        share[group] += pct
    total = sum(share.values()) or 1.0  # perf's percentages are of every thread's samples
    return {group: value / total for group, value in share.items()}


def steps_while_recorded(
    core: Any,
    seconds: float,
    out: str | None,
    after_step: Callable[[list[Any]], None] | None = None,
) -> tuple[int, float]:
    """Steps `core` while perf records this process into `out` (after a second for perf to
    attach; None: for `seconds`, unrecorded), handing each step's outputs to `after_step`:
    (steps, seconds they took)."""
    done = threading.Event()

    def sample() -> None:
        if out is None:
            time.sleep(seconds + 1.0)
        else:
            record(seconds, out)
        done.set()

    thread = threading.Thread(target=sample)
    thread.start()
    time.sleep(1.0)
    steps, start = 0, time.perf_counter()
    while not done.is_set():
        outputs = core.step()
        if after_step is not None:
            after_step(outputs)
        steps += 1
    elapsed = time.perf_counter() - start
    thread.join()
    return steps, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1])
    ap.add_argument("--seconds", type=float, default=8.0, help="of perf sampling per level")
    ap.add_argument("--op-by-op", action="store_true", help="the reference path's layers")
    ap.add_argument("--top", type=int, default=0, help="print the N largest symbols")
    ap.add_argument("--no-perf", action="store_true", help="step times only, unsampled")
    ap.add_argument("--block-sums", action="store_true", help="the block-sum products")
    ap.add_argument("--products", default="float", choices=["float", "limbs"])
    ap.add_argument(
        "--scoring", type=int, default=0, metavar="IN_FLIGHT",
        help="profile echo scoring instead: unrelated prompts, this many in flight",
    )  # fmt: skip
    ap.add_argument("--prompt-tokens", type=int, default=100, help="of each scored prompt")
    ap.add_argument(
        "--prefill", type=int, default=0, metavar="TOKENS",
        help="time instead one prompt of this many tokens (random ids) to its first token, twice",
    )  # fmt: skip
    args = ap.parse_args()

    import torch

    from probserve.engine import EngineConfig, EngineCore, EngineRequest, SamplingParams
    from probserve.engine.core.host import configure_threads
    from probserve.kernels.invariant import InvariantKernels
    from probserve.models import load_model
    from probserve.models.llama import LlamaForward

    configure_threads(0)
    loaded = load_model(args.model, "native")
    config = EngineConfig(
        deterministic=True, kv_cache_gib=2.0, block_sums=args.block_sums, products=args.products
    )
    core = EngineCore(loaded, config)
    core.warmup()
    if args.op_by_op:
        runner: object = core.runner
        runner.forward = LlamaForward(  # type: ignore[attr-defined]
            loaded.model, InvariantKernels(args.block_sums), loaded.weights, op_by_op=True
        )
    prompt = tuple(range(1000, 1100))
    print(f"model {loaded.name}, {torch.get_num_threads()} threads, op_by_op={args.op_by_op}")
    if args.prefill:
        time_prefill(core, args.prefill)
        return
    if args.scoring:
        profile_scoring(
            core, args.scoring, args.prompt_tokens, args.seconds, args.no_perf, args.top
        )
        return
    for streams in args.streams:
        for i in range(streams):
            core.add_request(
                EngineRequest(
                    f"s{streams}-{i}",
                    prompt[i:],
                    SamplingParams(
                        temperature=0,
                        max_tokens=core.info.max_context - len(prompt),
                        ignore_eos=True,
                    ),
                )
            )
        while core.scheduler.waiting or any(
            s.num_tokens - s.num_computed > 1 for s in core.scheduler.running
        ):
            core.step()  # every prompt in: decode only from here
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "step.perf")
            steps, elapsed = steps_while_recorded(core, args.seconds, None if args.no_perf else out)
            result = {} if args.no_perf else shares(out, args.top)
        for s in list(core.scheduler.running):
            core.abort_request(s.request_id)
        while core.has_work():
            core.step()
        text = ", ".join(f"{k} {v:.0%}" for k, v in sorted(result.items(), key=lambda kv: -kv[1]))
        print(
            f"{streams:>3} streams: {elapsed / steps * 1e3:.2f} ms a step "
            f"({streams * steps / elapsed:.1f} tok/s); {text}"
        )


def time_prefill(core: Any, length: int, rounds: int = 2) -> None:
    """One prompt of `length` random token ids (none seen before) to its first token, in the
    engine's chunks, `rounds` times: seconds each."""
    import random

    from probserve.engine import EngineRequest, SamplingParams

    rng = random.Random(0)
    for r in range(rounds):
        ids = tuple(rng.randrange(1000, 40000) for _ in range(length))
        core.add_request(EngineRequest(f"prefill-{r}", ids, SamplingParams(max_tokens=1)))
        start, steps = time.perf_counter(), 0
        while core.has_work():
            core.step()
            steps += 1
        print(f"prefill of {length} tokens: {time.perf_counter() - start:.2f} s, {steps} steps")


def profile_scoring(
    core: Any, in_flight: int, length: int, seconds: float, no_perf: bool, top: int
) -> None:
    """Echo scoring as lm-evaluation-harness sends it (max_tokens 0, every prompt token's
    logprob and rank): unrelated random prompts of `length` tokens (no shared prefix),
    `in_flight` at a time, each finished one replaced by a new one; ms per scored token and
    the profile."""
    import random

    from probserve.engine import EngineRequest, SamplingParams
    from probserve.engine.types import LogprobsSpec

    rng = random.Random(0)
    scored = 0
    count = 0

    def submit() -> None:
        nonlocal count
        count += 1
        ids = tuple(rng.randrange(1000, 40000) for _ in range(length))
        core.add_request(
            EngineRequest(
                f"score-{count}", ids, SamplingParams(max_tokens=0), LogprobsSpec(prompt_top_k=0)
            )
        )

    def after_step(outputs: list[Any]) -> None:
        nonlocal scored
        for out in outputs:
            if out.finished:
                scored += length - 1
                submit()

    for _ in range(in_flight):
        submit()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "score.perf")
        scored = 0
        _, elapsed = steps_while_recorded(core, seconds, None if no_perf else out, after_step)
        result = {} if no_perf else shares(out, top)
    text = ", ".join(f"{k} {v:.0%}" for k, v in sorted(result.items(), key=lambda kv: -kv[1]))
    print(
        f"scoring, {in_flight} in flight: {elapsed / scored * 1e3:.3f} ms a scored token "
        f"({scored / elapsed:.1f} prompt tok/s); {text}"
    )


if __name__ == "__main__":
    main()
