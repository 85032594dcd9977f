"""The same-run race: probserve against its peers, one machine, one script, one load client.

Each server is started in turn (probserve with `probserve serve`; vLLM's CPU build and
llama.cpp's server through ../shared/peers/), warmed up, measured with bench_serve's client on
the same token-id prompts, and stopped; the next one then has the machine to itself. The sweep:
streaming completions at each concurrency, then top-20 logprobs and no logprobs alternated
(A/B/A/B) at the two highest, then prompt scoring as lm-evaluation-harness sends it (echo,
max_tokens 1, logprobs 1). Peak RSS is summed over each server's process tree. The table gives
every figure and probserve's ratio to each peer; it is only meaningful within one run.

    .venv/bin/python bench/race.py --peers vllm            # ~10 minutes with vLLM's start
    .venv/bin/python bench/race.py --peers vllm llama --concurrency 1 4 16 32
    .venv/bin/python bench/race.py --peers llama --alternate 4   # + one-stream A/B/A/B rounds
    .venv/bin/python bench/race.py --peers vllm --alternate-scoring 4 --no-sweep  # scoring only

`--model FILE` races a GGUF file of your own (every server serves that same file; vLLM a float32
directory of it) instead of the embedded model:

    .venv/bin/python bench/race.py --peers llama --model gemma-3-270m.gguf --concurrency 1 16

`--variant LABEL=FLAGS` (repeatable) runs probserve once per variant instead of once, for a
same-run A/B of its own settings; the first variant is the base of every ratio:

    .venv/bin/python bench/race.py --peers --variant off=--no-deterministic \
        --variant deterministic=--deterministic

`--tree LABEL=DIR` (repeatable) adds a probserve of another checkout (its `src/` first on
PYTHONPATH, for the server and its workers), after this tree's, for a same-run A/B of two
commits (`git worktree add /tmp/before COMMIT`):

    .venv/bin/python bench/race.py --peers --no-sweep --alternate 2 --tree before=/tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_serve import make_prompts_local, mc_prompts, run_level, run_scoring

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def tree_peak_rss(pid: int) -> int:
    """Sum of VmHWM (kB) over a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(
                next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1]
            )
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of a process and its descendants, by command line."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
            out[f"{p} {cmd}"] = (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError):
            continue
    return out


class Server:
    def __init__(
        self, name: str, cmd: list[str], port: int, model: str, log: Path, scores: bool = True
    ) -> None:
        """`scores`: the server returns prompt logprobs (echo), so the scoring sweep applies."""
        self.name, self.cmd, self.port, self.model, self.log = name, cmd, port, model, log
        self.scores = scores
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds = 0.0

    def start(self, timeout: float = 600) -> None:
        started = time.monotonic()
        out = self.log.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited at start; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_seconds = time.monotonic() - started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise SystemExit(f"{self.name} did not start in {timeout:g} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, as an operator stops it; then every process
        of its session must be gone within 10 s (any left is named, and killed)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            deadline = time.monotonic() + 10
            while session_members(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in session_members(self.proc.pid):
                print(f"!! {self.name} left process {pid} behind: killing it", flush=True)
                os.kill(pid, signal.SIGKILL)


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of the session `sid`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            text = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split() if text else []
        if fields and fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def probserve_processes() -> set[int]:
    """Every live process running probserve (a server or an engine worker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if b"probserve" in cmd and int(entry.name) != os.getpid() and b"race.py" not in cmd:
            found.add(int(entry.name))
    return found


def model_flags(args: argparse.Namespace) -> list[str]:
    """probserve's flags for `--model FILE` (none for the embedded model)."""
    return ["--model", args.model, "--served-model-name", "bench"] if args.model else []


def llama_command(model: str | None, port: int, slots: int, context: int) -> list[str]:
    """llama.cpp's server (../shared/peers/llama_server.sh builds it once) on a GGUF file
    (`model`; the embedded model's file where None), two threads, as the races run it."""
    binary = subprocess.run(["bash", str(PEERS / "llama_server.sh")], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    if model is None:
        model_dir = subprocess.run(["bash", str(PEERS / "model.sh")], capture_output=True,
                                   text=True, check=True).stdout.strip()  # fmt: skip
        model = f"{model_dir}/model.gguf"
    # --no-repack: its AMX kernels (reached through weight repacking) die with SIGILL on VMs
    # whose CPUID lists AMX without granting it (gdb: tinygemm_kernel_amx); without them it
    # runs its AVX-512/AVX2 dot products, its usual CPU path
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(context), "-t", "2", "--no-repack"]  # fmt: skip


def build_servers(args: argparse.Namespace, hf_dir: str, logs: Path) -> list[Server]:
    variants = [v.split("=", 1) for v in args.variant] or [["now" if args.tree else "", ""]]
    here = [str(Path(sys.executable).parent / "probserve")]
    # (label, the command that runs `probserve`, flags): this tree's variants, then other trees
    runs = [(label, here, flags) for label, flags in variants] + [
        (label, ["env", f"PYTHONPATH={Path(tree).resolve() / 'src'}", sys.executable, "-m",
                 "probserve.cli"], "")
        for label, tree in (t.split("=", 1) for t in args.tree)
    ]  # fmt: skip
    servers = [
        Server(
            f"probserve ({label})" if label else "probserve",
            [*exe, "serve", "--port", str(8020 + i), "--log-level", "warning",
             *model_flags(args), *args.probserve_args.split(), *flags.split()],
            8020 + i, "bench" if args.model else "smollm2-135m-instruct",
            logs / f"probserve{i}.log",
        )
        for i, (label, exe, flags) in enumerate(runs)
    ]  # fmt: skip
    if "vllm" in args.peers:
        cmd = ["bash", str(PEERS / "vllm_cpu.sh"), hf_dir, "8012"]
        servers.append(Server("vllm-cpu", cmd, 8012, "smollm2", logs / "vllm.log"))
    if "llama" in args.peers:
        # 32 slots share -c: each gets the sweep's longest request (a 4,000-token prompt too)
        context = max(16384, 32 * (args.prompt_tokens + args.output_tokens + 64))
        cmd = llama_command(args.model, 8013, 32, context)
        # llama-server returns no prompt logprobs (no echo): it sits the scoring sweep out
        servers.append(Server("llama-server", cmd, 8013, "smollm2", logs / "llama.log", False))
    return servers


def measure(server: Server, args: argparse.Namespace, pools: dict) -> dict:
    """The whole sweep against one running server."""
    out: dict = {"start_seconds": round(server.start_seconds, 1), "levels": {}}
    warm = pools["warm"]  # prompts no level measures: no prefix cache serves a measured one
    asyncio.run(run_level(server.url, server.model, warm, 2, 8, None, args.timeout))
    for conc in args.concurrency:
        prompts = pools["stream"][: conc * args.requests_per_stream]
        before = tree_cpu_seconds(server.proc.pid)  # type: ignore[union-attr]
        row = asyncio.run(run_level(server.url, server.model, prompts, conc, args.output_tokens,
                                    None, args.timeout, args.temperature))  # fmt: skip
        after = tree_cpu_seconds(server.proc.pid)  # type: ignore[union-attr]
        # where the time goes: each server process's CPU use during this level, in cores
        row["cores_by_process"] = {
            name: round((cpu - before.get(name, 0.0)) / row["seconds"], 2)
            for name, cpu in after.items()
            if cpu - before.get(name, 0.0) > 0.01 * row["seconds"]
        }
        out["levels"][str(conc)] = row
        print(server.name, json.dumps(row), flush=True)
    for conc in args.concurrency[-2:]:  # logprobs off / on, alternated
        prompts = pools["stream"][: conc * args.requests_per_stream]
        for label, lp in (("off", None), ("top20", 20), ("off", None), ("top20", 20)):
            row = asyncio.run(run_level(server.url, server.model, prompts, conc, args.output_tokens,
                                        lp, args.timeout, args.temperature))  # fmt: skip
            out["levels"].setdefault(f"{conc}-{label}", []).append(row["tok_per_s"])
            print(server.name, f"{conc} streams, logprobs {label}:", row["tok_per_s"], flush=True)
    if not args.no_scoring and server.scores:
        row = asyncio.run(run_scoring(server.url, server.model, pools["unrelated"], 8,
                                      args.timeout))  # fmt: skip
        out["scoring"] = row["prompt_tok_per_s"]
        row = asyncio.run(run_scoring(server.url, server.model, pools["mc"], 8, args.timeout))
        out["scoring_mc"] = row["prompt_tok_per_s"]
        print(server.name, "scoring", out["scoring"], "mc", out["scoring_mc"], flush=True)
    out["peak_rss_mb"] = round(tree_peak_rss(server.proc.pid) / 1024)  # type: ignore[union-attr]
    return out


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    names = list(results)
    peers = names[1:]
    lines = ["| figure | " + " | ".join(names) + "".join(f" | {names[0]} / {p}" for p in peers)
             + " |", "|---" + "|---:" * (len(names) + len(peers)) + "|"]  # fmt: skip

    def row(label: str, values: list[float | None]) -> None:
        ours = values[0]
        ratios = [f"{ours / v:.2f}x" if ours is not None and v else "-" for v in values[1:]]
        shown = ["-" if v is None else f"{v:g}" for v in values]
        lines.append(f"| {label} | " + " | ".join(shown + ratios) + " |")

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 1)

    for conc in args.concurrency:
        row(f"output tok/s, {conc} streams",
            [results[n]["levels"][str(conc)]["tok_per_s"] for n in names])  # fmt: skip
    for conc in args.concurrency[-2:]:
        for label in ("off", "top20"):
            row(f"output tok/s, {conc} streams, logprobs {label} (mean of 2, alternated)",
                [mean(results[n]["levels"][f"{conc}-{label}"]) for n in names])  # fmt: skip
    top = str(args.concurrency[-1])
    ttft = [results[n]["levels"][top]["ttft_p50"] for n in names]
    ratios = "".join(
        f" | {ttft[0] / t:.2f}x (lower is better)" if ttft[0] and t else " | -" for t in ttft[1:]
    )
    lines.append(f"| TTFT p50 at {top} streams (s) | " + " | ".join(map(str, ttft)) + ratios + " |")
    if not args.no_scoring:
        row("scoring, unrelated prompts (prompt tok/s)",
            [results[n].get("scoring") for n in names])  # fmt: skip
        row("scoring, lm-eval multiple choice (prompt tok/s)",
            [results[n].get("scoring_mc") for n in names])  # fmt: skip
    rss = [results[n]["peak_rss_mb"] for n in names]
    lines.append("| peak RSS, all processes (MB) | " + " | ".join(map(str, rss))
                 + " |" + " - |" * len(peers))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", nargs="*", default=["vllm"], choices=["vllm", "llama"])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--probserve-args", default="", help="extra flags for probserve serve")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                    help="run probserve once per variant with these extra flags")  # fmt: skip
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                    help="also run the probserve of another checkout")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the measured completions (a seed each, of its prompt) instead "
                         "of greedy: text that does not repeat (speculation's cost)")  # fmt: skip
    ap.add_argument("--no-scoring", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--logs", default="/tmp/probserve-race")
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="then one-stream rounds, servers alternated")  # fmt: skip
    ap.add_argument("--alternate-streams", type=int, default=1, metavar="N",
                    help="the streams of --alternate's rounds (default 1)")  # fmt: skip
    ap.add_argument("--alternate-scoring", type=int, default=0, metavar="ROUNDS",
                    help="then scoring rounds (new prompts each), servers alternated")  # fmt: skip
    ap.add_argument(
        "--no-sweep",
        action="store_true",
        help="only the alternated rounds (each server started once for them)",
    )
    args = ap.parse_args()
    already = probserve_processes()

    from probserve.models import load_tokenizer, prepared_source
    from probserve.models.loader import float32_directory

    source = prepared_source(args.model)
    # the model as a float32 HF directory: vLLM's input (written only where vLLM races)
    hf_dir = float32_directory(args.model) if "vllm" in args.peers else ""
    tokenizer = load_tokenizer(source)
    n = max(*args.concurrency, args.alternate_streams) * args.requests_per_stream
    pools = {
        "stream": make_prompts_local(tokenizer, n, args.prompt_tokens, seed=0),
        "unrelated": make_prompts_local(tokenizer, 64, args.prompt_tokens, seed=1),
        "warm": make_prompts_local(tokenizer, 2, args.prompt_tokens, seed=3),
        "mc": mc_prompts(make_prompts_local(tokenizer, 16, args.prompt_tokens, seed=2), 4, 5, 1),
        "rounds": [
            make_prompts_local(tokenizer, 64, args.prompt_tokens, seed=100 + r)
            for r in range(args.alternate_scoring)
        ],
    }
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for server in [] if args.no_sweep else build_servers(args, hf_dir, logs):
        print(f"== {server.name}: starting", flush=True)
        server.start()
        try:
            results[server.name] = measure(server, args, pools)
        finally:
            server.stop()
        print(server.name, "result", json.dumps(results[server.name]), flush=True)
    kinds = ((False, args.alternate), (True, args.alternate_scoring))
    rounds = [alternate(args, pools, logs, hf_dir, sc) for sc, n in kinds if n]
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores")
    print("command: .venv/bin/python bench/race.py " + " ".join(sys.argv[1:]))
    if results:
        print(json.dumps(results))
        print(table(results, args))
    for text in rounds:
        print(text)
    left = probserve_processes() - already
    print(f"processes left behind: {sorted(left) or 'none'}")
    if left:
        raise SystemExit(1)


PAUSE = 3.0  # seconds between alternated rounds


def alternate(args: argparse.Namespace, pools: dict, logs: Path, hf_dir: str, scoring: bool) -> str:
    """Rounds of one workload, server after server (the order reversed every other round,
    after one unmeasured request each), with every server up at once (idle while another is
    measured): a ratio that the machine's drift over the sweep (minutes apart) cannot move.
    One stream (`--alternate`; `--alternate-streams N`: N streams): vLLM sits out (it takes
    minutes to start, and the sweep has its figure). Scoring (`--alternate-scoring`):
    llama-server sits out (no prompt logprobs); each round's 64 prompts are new to every
    server, so no prefix cache helps, and every server scores the same ones."""
    rounds = args.alternate_scoring if scoring else args.alternate
    skip = "llama-server" if scoring else "vllm-cpu"
    servers = [s for s in build_servers(args, hf_dir, logs) if s.name != skip]
    figures: dict[str, list[float]] = {s.name: [] for s in servers}
    streams = args.alternate_streams
    label = "scoring (prompt tok/s)" if scoring else f"{streams} stream" + "s" * (streams > 1)
    try:
        for server in servers:
            server.start()
        for server in servers:  # a first request each, unmeasured: no round pays a warm-up
            asyncio.run(run_level(server.url, server.model, pools["unrelated"][:1], 1, 16, None,
                                  args.timeout))  # fmt: skip
        for r in range(rounds):
            # A B, then B A: neither server always runs first (or right after the other)
            for server in servers if r % 2 == 0 else servers[::-1]:
                time.sleep(PAUSE)  # the last server's threads stop spinning (llama's --poll)
                before = {s.name: sum(tree_cpu_seconds(s.proc.pid).values()) for s in servers}  # type: ignore[union-attr]
                if scoring:
                    row = asyncio.run(run_scoring(server.url, server.model, pools["rounds"][r], 8,
                                                  args.timeout))  # fmt: skip
                    figure = row["prompt_tok_per_s"]
                else:
                    some = pools["stream"][: streams * args.requests_per_stream]
                    n = args.output_tokens
                    row = asyncio.run(run_level(server.url, server.model, some, streams, n, None,
                                                args.timeout, args.temperature))  # fmt: skip
                    figure = row["tok_per_s"]
                idle = {s.name: round((sum(tree_cpu_seconds(s.proc.pid).values())  # type: ignore[union-attr]
                                       - before[s.name]) / row["seconds"], 2)
                        for s in servers if s is not server}  # fmt: skip
                figures[server.name].append(figure)
                print(server.name, f"alternated, {label}:", figure,
                      "| cores the idle servers used meanwhile:", idle, flush=True)  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    means = {name: sum(v) / len(v) for name, v in figures.items()}
    base = next(iter(means))
    lines = [f"\n| {label}, {rounds} alternated rounds | mean | rounds | {base} / this |",
             "|---|---:|---|---:|"]  # fmt: skip
    for name, mean in means.items():
        shown = ", ".join(f"{v:g}" for v in figures[name])
        lines.append(f"| {name} | {mean:.1f} | {shown} | {means[base] / mean:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
