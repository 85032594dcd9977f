"""WorkerEngine: the engine hosted in a worker process of its own (the default).

The server process only parses, tokenizes, formats and streams; the worker (worker.py) runs the
scheduler and the model, so HTTP and JSON work never compete with the step loop for the GIL. They
talk over two ZeroMQ sockets in a private temporary folder with the messages of wire.py: requests
and aborts go out as they come, each engine step's outputs come back in one message, read by a
thread that hands them to the request streams. When the worker exits unexpectedly every open
stream ends with an error and `on_fatal` runs (the server exits non-zero, for its supervisor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from probserve.engine import wire
from probserve.engine.client import EngineClient
from probserve.engine.config import EngineConfig
from probserve.engine.info import EngineInfo
from probserve.engine.types import EngineDead, EngineRequest, RequestError

log = logging.getLogger(__name__)

START_TIMEOUT = 900.0  # seconds a worker may take to load and warm up (a first GGUF conversion)
POLL_MS = 200  # how often the reader checks that the worker is alive


class WorkerEngine(EngineClient):
    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        max_pending: int = 1024,
        draft: str | None = None,
        stall_timeout: float = 120.0,
        log_level: str = "info",
        log_format: str = "text",
    ) -> None:
        super().__init__(max_pending, stall_timeout)
        self.model, self.draft = model, draft  # draft: --speculative draft's model
        self.config = config or EngineConfig()
        self.log_level = log_level
        self.log_format = log_format
        self.startup_seconds: float | None = None  # the worker's own figure, from its Hello
        self.loaded_spec: str | None = None  # what the worker loaded (a GGUF's converted dir)
        self.tokenizer_class = ""  # the class of the worker's tokenizer (wire.Hello.tokenizer)
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._commands: zmq.Socket | None = None
        self._events: zmq.Socket | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._start_lock = threading.Lock()
        self._encode = wire.Codec(wire.Event).encode
        self._decode = wire.Codec(wire.Event).decode

    # ---- lifecycle ------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the worker process (returns at once; `start()` waits for it to be ready)."""
        if self._proc is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="probserve-")
        commands, events = f"ipc://{self._dir}/commands", f"ipc://{self._dir}/events"
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._events = self._ctx.socket(zmq.PULL)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(commands)
        self._events.bind(events)
        cmd = [
            sys.executable,
            "-m",
            "probserve.engine.worker",
            "--model",
            self.model,
            "--config",
            json.dumps(dataclasses.asdict(self.config)),
            "--commands",
            commands,
            "--events",
            events,
            "--log-level",
            self.log_level,
            "--log-format",
            self.log_format,
            "--parent-pid",
            str(os.getpid()),
            *(("--draft-model", self.draft) if self.draft else ()),
        ]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.pid = self._proc.pid
        log.info("engine worker started (pid %d)", self.pid)

    def start(self) -> None:
        """Launch the worker if needed and wait until it has loaded the model and warmed up."""
        with self._start_lock:
            if self._reader is None and self._dead is None:
                self.launch()
                self._await_hello()
                self._reader = threading.Thread(
                    target=self._listen, name="probserve-worker-reader", daemon=True
                )
                self._reader.start()
        if self._dead is not None:
            raise EngineDead(self._dead)

    def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with self._lock, contextlib.suppress(EngineDead):  # a worker already on its way out
                self._post(wire.Shutdown())
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                log.warning("engine worker %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        for sock in (self._commands, self._events):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._ctx = self._commands = self._events = None
        self._dir = None

    # ---- EngineClient ---------------------------------------------------------------------
    def _send(self, adds: list[EngineRequest], aborts: list[str]) -> None:
        if adds:
            try:
                self._post(wire.Submit(requests=[wire_safe(r, self.info) for r in adds]))
            except (OverflowError, msgspec.EncodeError) as exc:  # a number msgpack cannot hold
                raise RequestError(f"a value of this request is out of range: {exc}") from exc
        if aborts:
            self._post(wire.Abort(request_ids=aborts))

    def _host_alive(self) -> str | None:
        """Read from the process itself at every call, so a probe right after a crash is told
        so before the reader thread has noticed."""
        proc = self._proc
        if proc is None or self._stopping:
            return None
        if proc.poll() is not None:
            return f"the engine worker has exited (status {proc.returncode})"
        if exiting(proc.pid):
            return "the engine worker has exited"
        return None

    # ---- the sockets ------------------------------------------------------------------------
    def _post(self, message: wire.Message) -> None:
        """Send one command (with the lock held: one sender at a time)."""
        assert self._commands is not None
        try:
            self._commands.send(self._encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise EngineDead(f"the engine worker cannot be reached: {exc}") from exc

    def _await_hello(self) -> None:
        assert self._events is not None and self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._events.poll(POLL_MS):
                message = self._decode(self._events.recv(copy=False).buffer)
                if isinstance(message, wire.Hello):
                    self.info = message.info
                    self.startup_seconds = message.startup_seconds
                    self.loaded_spec = message.model
                    self.tokenizer_class = message.tokenizer
                    log.info(
                        "engine worker %d ready: %s, %d KV tokens, started in %.1f s",
                        message.pid,
                        message.info.runner,
                        message.info.kv_cache_tokens,
                        message.startup_seconds,
                    )
                    return
                if isinstance(message, wire.Failed):
                    self._die(message.reason)
                    return
            elif self._proc.poll() is not None:
                self._die(f"the engine worker exited (status {self._proc.returncode}) at start")
                return
        self._proc.kill()
        self._die(f"the engine worker was not ready after {START_TIMEOUT:g} s")

    def _listen(self) -> None:
        """The reader thread: deliver each step's outputs; notice when the worker is gone."""
        assert self._events is not None and self._proc is not None
        failed: str | None = None
        while True:
            try:
                while self._events.poll(POLL_MS):
                    message = self._decode(self._events.recv(copy=False).buffer)
                    if isinstance(message, wire.StepOutputs):
                        self._deliver(message.outputs, message.stats)
                    elif isinstance(message, wire.Failed):
                        failed = message.reason
            except Exception as exc:  # an unreadable message: nothing it says can be trusted
                log.exception("engine worker protocol failure")
                self._proc.kill()
                self._die(f"engine protocol failure: {exc}")
                return
            code = self._proc.poll()
            if code is not None:
                if self._stopping:
                    return
                if self.shutting_down:  # not a crash: the server is going too
                    reason = failed or f"the engine worker exited (status {code})"
                    log.warning("%s while the server shuts down", reason)
                else:
                    reason = failed or f"the engine worker exited unexpectedly (status {code})"
                    log.critical("%s", reason)
                self._die(reason)
                return


def exiting(pid: int) -> bool:
    """Whether the process `pid` (a child of ours not yet reaped) has ended or is ending, as
    Linux's /proc tells it: a killed process's main thread is a zombie while its other threads
    still unwind, and `waitpid` (Popen.poll) reports the exit only once they all have, tens of
    milliseconds later; `poll` also answers None while another thread is reaping. False where
    there is no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # reaped meanwhile by our reader thread
        return Path("/proc/self/stat").exists()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :][:1] in ("Z", "X", "x")


def wire_safe(req: EngineRequest, info: EngineInfo) -> EngineRequest:
    """The same request with its integers in msgpack's range, meaning the same to the engine:
    a seed modulo 2**64 (as the engine seeds), a top-k past the vocabulary off, min_tokens past
    the context at the context."""
    sp = req.sampling
    changes: dict[str, int] = {}
    if sp.seed is not None and not 0 <= sp.seed < 2**64:
        changes["seed"] = sp.seed % 2**64
    if sp.top_k >= info.vocab_size:
        changes["top_k"] = 0
    if sp.min_tokens > info.max_context:
        changes["min_tokens"] = info.max_context
    if not changes:
        return req
    return dataclasses.replace(req, sampling=dataclasses.replace(sp, **changes))  # type: ignore[arg-type]
