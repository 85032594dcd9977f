"""What the hostile-client suites share: the error envelope check, a raw body post, and the
after-check (the canary answers exactly as before; the server is ok and idle)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from hostile import CANARY  # the canary of bench/hostile.py


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI error envelope of `r`, asserted to have `status` (and `param`, if given)."""
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def post_raw(c: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return c.post(path, content=raw, headers={"content-type": "application/json"})


def canary(c: httpx.Client) -> object:
    return c.post("/v1/completions", json=CANARY).json()["choices"]


def check_after(c: httpx.Client, canary_before: object) -> None:
    """The server is ok and idle (within 60 s) and the canary answers exactly as before."""
    deadline = time.monotonic() + 60
    while True:
        r = c.get("/health")
        h = r.json()
        idle = h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0
        if (r.status_code == 200 and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200 and h["status"] == "ok" and idle, h
    assert canary(c) == canary_before


def rss_status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def watched(url: str, work: Callable[[], object]) -> tuple[object, float, float]:
    """Run `work` while polling /health: its result, the slowest /health answer (s) and the
    process's peak RSS growth over it (MB)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = rss_status("VmRSS")
    stop = threading.Event()
    worst = [0.0]

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=120) as h:
            while not stop.is_set():
                t = time.perf_counter()
                h.get("/health")
                worst[0] = max(worst[0], time.perf_counter() - t)
                stop.wait(0.05)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    grew = (rss_status("VmHWM") - base) / 2**20
    print(f"\nFIGURES worst /health {worst[0]:.3f} s, peak RSS growth {grew:.0f} MB")
    return result, worst[0], grew
