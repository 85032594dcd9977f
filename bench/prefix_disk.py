"""Time to first token of a long prompt with its prefix restored from the prefix cache on disk
(--prefix-cache-dir) after a restart, against computing it cold: an engine on the embedded model
(native weights, deterministic, the server's defaults) runs the prompt once (cold), is closed
(its blocks written), and a new engine on the same directory runs it again (restored); the two
answers' numbers are compared bit for bit. The files are read from the page cache (just
written); a disk read from cold storage adds its own time.

`--peer llama` then does the same with llama.cpp's server and its own persistent prompt cache
(`--slot-save-path`; bench/race.py's build, one slot): the prompt cold, `POST
/slots/0?action=save`, the server stopped and started again, `POST /slots/0?action=restore`,
the prompt again (restore time + time to first token); the two answers' top-5 logprobs are
compared (the largest difference where they are not the same). A save or restore the build
refuses is printed as such: that is the result.

    python bench/prefix_disk.py [--tokens 8000] [--model SPEC] [--peer llama]
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from race import Server, llama_command  # type: ignore[import-not-found]

from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams
from probserve.engine.config import EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.models import load_model, prepared_source


def first_token(core: EngineCore, prompt: tuple[int, ...]) -> tuple[float, list[bytes]]:
    req = EngineRequest(
        "r", prompt, SamplingParams(temperature=0.0, max_tokens=1), LogprobsSpec(top_k=5)
    )
    t = time.perf_counter()
    core.add_request(req)
    outs = []
    while core.has_work():
        outs += core.step()
    elapsed = time.perf_counter() - t
    bits = [np.asarray(o.new_token_ids).tobytes() for o in outs]
    bits += [np.asarray(o.logprobs.top_logprobs).tobytes() for o in outs if o.logprobs]
    return elapsed, bits


WARMUP = tuple(range(100, 132))  # a first request shares no prefix with the measured prompt


def llama_first_token(url: str, prompt: tuple[int, ...]) -> tuple[float, dict]:
    """One token for `prompt` on llama-server's slot 0 (its prompt cache on): seconds, answer."""
    body = {"prompt": list(prompt), "n_predict": 1, "temperature": 0, "n_probs": 5,
            "cache_prompt": True, "id_slot": 0}  # fmt: skip
    t = time.perf_counter()
    r = httpx.post(f"{url}/completion", json=body, timeout=3600)
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    return elapsed, r.json()


def slot_action(url: str, action: str, filename: str) -> tuple[float, httpx.Response]:
    t = time.perf_counter()
    r = httpx.post(f"{url}/slots/0?action={action}", json={"filename": filename}, timeout=3600)
    return time.perf_counter() - t, r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_restore(gguf: str, prompt: tuple[int, ...], logs: Path) -> str:
    """llama-server's slot save and restore across a restart for `prompt`: one line."""
    port = free_port()
    with tempfile.TemporaryDirectory() as slots:
        cmd = [*llama_command(gguf, port, 1, len(prompt) + 64), "--slot-save-path", slots]
        server = Server("llama-server", cmd, port, "", logs / "llama-prefix-disk.log", False)
        server.start()
        try:
            llama_first_token(server.url, WARMUP)  # as the engines' warmup(): unmeasured
            cold_s, cold = llama_first_token(server.url, prompt)
            save_s, saved = slot_action(server.url, "save", "prefix.bin")
        finally:
            server.stop()
        if saved.status_code != 200:
            return f"llama-server: slot save failed ({saved.status_code}: {saved.text[:300]})"
        size = sum(p.stat().st_size for p in Path(slots).iterdir()) / 2**20
        server = Server("llama-server", cmd, port, "", logs / "llama-prefix-disk-2.log", False)
        server.start()
        try:
            llama_first_token(server.url, WARMUP)
            restore_s, restored = slot_action(server.url, "restore", "prefix.bin")
            if restored.status_code != 200:
                return (f"llama-server: slot restore failed ({restored.status_code}: "
                        f"{restored.text[:300]}); cold {cold_s:.2f} s")  # fmt: skip
            warm_s, warm = llama_first_token(server.url, prompt)
        finally:
            server.stop()
    computed = warm.get("timings", {}).get("prompt_n")
    total = restore_s + warm_s
    return (
        f"llama-server (--slot-save-path): {len(prompt)} tokens: cold {cold_s:.2f} s, restored "
        f"{total:.3f} s ({cold_s / total:.1f}x: restore {restore_s:.3f} s + first token "
        f"{warm_s:.3f} s, {computed} prompt tokens computed); save {save_s:.3f} s, "
        f"{size:.0f} MiB; {same_numbers(cold, warm)}"
    )


def same_numbers(cold: dict, warm: dict) -> str:
    """Whether llama-server's restored answer has the cold one's top-5 logprobs, bit for bit."""
    a, b = cold.get("completion_probabilities"), warm.get("completion_probabilities")
    if a == b:
        return "same top-5 logprobs: True"
    if not a or not b:
        return f"same top-5 logprobs: False (cold {a!r}, restored {b!r})"
    top = [[(t["id"], t["logprob"]) for t in x[0]["top_logprobs"]] for x in (a, b)]
    by_id = [dict(t) for t in top]
    diff = max(abs(by_id[0][i] - by_id[1][i]) for i in by_id[0].keys() & by_id[1].keys())
    order = [i for i, _ in top[0]] == [i for i, _ in top[1]]
    return (f"same top-5 logprobs: False (largest difference {diff:.3g}, "
            f"the same order: {order})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--peer", choices=["llama"], default=None, help="also llama-server's restore")
    ap.add_argument("--logs", default="/tmp/probserve-prefix-disk", help="the peer's log folder")
    args = ap.parse_args()
    t = time.perf_counter()
    loaded = load_model(args.model, "native")
    print(f"load {time.perf_counter() - t:.1f} s")
    text = "def tool_%d(path: str, mode: str = 'r') -> dict:  # reads a file, returns its stats\n"
    ids: list[int] = []
    i = 0
    while len(ids) < args.tokens:
        ids += loaded.tokenizer(text % i).input_ids
        i += 1
    prompt = tuple(ids[: args.tokens])
    with tempfile.TemporaryDirectory() as directory:
        config = EngineConfig(prefix_cache_dir=directory)
        t = time.perf_counter()
        cold = EngineCore(loaded, config)
        print(
            f"engine (fingerprint {cold.info.system_fingerprint}) {time.perf_counter() - t:.2f} s"
        )
        cold.warmup()
        cold_s, cold_bits = first_token(cold, prompt)
        t = time.perf_counter()
        cold.close()
        written = cold.stats().prefix_cache_disk_bytes / 2**20
        print(f"shutdown write: {time.perf_counter() - t:.2f} s, {written:.0f} MiB")
        warm = EngineCore(loaded, config)
        warm.warmup()
        warm_s, warm_bits = first_token(warm, prompt)
        stats = warm.stats()
        warm.close()
    print(
        f"probserve (--prefix-cache-dir): {len(prompt)} tokens: cold {cold_s:.2f} s, restored "
        f"{warm_s:.3f} s ({cold_s / warm_s:.1f}x); {stats.prefix_cache_disk_hits} blocks read "
        f"back; same bits: {cold_bits == warm_bits}"
    )
    if args.peer == "llama":
        gguf = prepared_source(args.model).quantized_file
        if gguf is None:
            print("llama-server: not run (the model is no GGUF file)")
            return
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        del loaded, cold, warm  # the peer gets the memory
        try:
            line = llama_restore(gguf, prompt, logs)
        except SystemExit as exc:  # race.Server: it did not start (a flag this build lacks)
            line = f"llama-server: not measured ({exc})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
