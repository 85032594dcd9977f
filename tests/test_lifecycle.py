"""The server's processes live and die together, as an operator stops them: a SIGTERM to the
whole process group (what `systemctl stop` sends) drains and leaves nothing behind and restarts
nothing; a server SIGKILLed at any stage of its worker's start leaves no worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_util import InFlight, finish_reason, free_port, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc are Linux's"),
]

PROBSERVE = [sys.executable, "-m", "probserve.cli", "serve", "--kv-cache-gib", "0.25"]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None for no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of the session `sid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
                pids.append(int(entry.name))
    return pids


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        return []
    return sorted(int(x) for t in tasks.iterdir() for x in (t / "children").read_text().split())


@contextmanager
def server_session(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`probserve serve` in a session of its own (its pid is the session's and the group's);
    whatever the test leaves of it is killed at the end."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*PROBSERVE, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_to_the_process_group_drains_restarts_nothing_and_leaves_nothing(tmp_path):
    with server_session(tmp_path) as (proc, url, log):
        assert wait_until(lambda: healthy(url) or proc.poll() is not None, 300), log.read_text()
        flight = InFlight(url, {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True})
        assert flight.started.wait(60)  # its first token is out: the request is in flight
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker alike
        status, events, done = flight.join()
        assert proc.wait(timeout=60) == 0
        # the worker outlived the signal: the request in flight finished
        assert status == 200 and done and finish_reason(events) == "length", events[-2:]
        assert wait_until(lambda: not session_members(proc.pid), 10), session_members(proc.pid)
        text = log.read_text()
        assert "restart" not in text and "died" not in text and "unexpectedly" not in text, text


def test_health_says_loading_until_ready_and_a_sigterm_while_loading_ends_the_server(tmp_path):
    """The port answers from the start: 503 "loading" on /health, 503 in the error envelope
    elsewhere; a SIGTERM then stops the server (exit 0) and its half-started worker."""
    with server_session(tmp_path) as (proc, url, log):
        first: list[httpx.Response] = []

        def answered() -> bool:
            try:
                first.append(httpx.get(f"{url}/health", timeout=2))
            except httpx.HTTPError:
                return proc.poll() is not None
            return True

        assert wait_until(answered, 60) and first, log.read_text()
        # the worker imports torch and loads for seconds: the first answer comes before that
        assert first[0].status_code == 503, first[0].text
        assert first[0].json()["status"] == "loading"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "loading", r.text
        assert wait_until(lambda: children(proc.pid), 60), log.read_text()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert wait_until(lambda: not session_members(proc.pid), 15), session_members(proc.pid)
        assert "stopped while the models were loading" in log.read_text()


def test_health_turns_ok_once_loaded_and_the_ready_line_names_the_urls(tmp_path):
    with server_session(tmp_path) as (proc, url, log):
        assert wait_until(lambda: healthy(url) or proc.poll() is not None, 300), log.read_text()
        text = log.read_text()
        assert "/health says loading until the models are ready" in text
        assert f"on {url}/v1 (playground: {url}/playground)" in text
        assert "warming up" in text and "done in" in text, text
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# the stages of a worker's start, each told by what the test can see
STAGES = {
    "spawn": lambda proc, url, log: children(proc.pid),  # the process exists, nothing more
    "load": lambda proc, url, log: "[worker]: loading" in log.read_text(),
    "warm-up": lambda proc, url, log: "[worker]: warming up" in log.read_text(),
    "ready": lambda proc, url, log: healthy(url),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_server_killed_while_its_worker_starts_leaves_no_worker(tmp_path, stage):
    with server_session(tmp_path) as (proc, url, log):
        reached = STAGES[stage]
        assert wait_until(lambda: reached(proc, url, log) or proc.poll() is not None, 300)
        workers = children(proc.pid)
        assert workers and proc.poll() is None, log.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: not session_members(proc.pid), 15), (
            session_members(proc.pid),
            log.read_text(),
        )
