"""The engine worker process: `python -m probserve.engine.worker`, started by WorkerEngine.

It loads the model, builds the engine, warms it up, says Hello and then loops: read every command
waiting (blocking only while it has no work), apply them, run one step, send the step's outputs
and figures. It exits on Shutdown, when the server process that started it (`--parent-pid`) has
gone, or after an unexpected error (sending Failed first, exit status 1). The protocol is in
wire.py.

Its life is its server's: the kernel kills it when the server's starting thread ends
(PR_SET_PDEATHSIG), a worker whose server was gone before that was set exits at once, and a
SIGTERM (an operator stopping the whole process group, as `systemctl stop` does) is left to the
server, which drains the requests in flight and then sends Shutdown.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import zmq

from probserve.engine import wire
from probserve.engine.config import EngineConfig
from probserve.engine.types import EngineRequest
from probserve.logs import configure_logging

if TYPE_CHECKING:  # the engine (and torch) load in main, once the worker follows its server
    from probserve.engine.core.engine import EngineCore

log = logging.getLogger("probserve.worker")

IDLE_POLL_MS = 1000  # how often an idle worker checks that its server is still there


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="probserve-worker")
    p.add_argument("--model", required=True, help="a model directory (or any --model spec)")
    p.add_argument("--draft-model", default=None, help="--speculative draft's draft model")
    p.add_argument("--parent-pid", type=int, default=0, help="the server's pid (default: ours)")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--commands", required=True, help="ZeroMQ address to read commands from")
    p.add_argument("--events", required=True, help="ZeroMQ address to send events to")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    return p.parse_args(argv)


def follow_parent(parent: int) -> bool:
    """Live exactly as long as the server `parent`: on Linux the kernel kills this process when
    the server's thread that started it ends, however it ends (PR_SET_PDEATHSIG). Ctrl-C and
    SIGTERM are the server's to handle while it lives (it drains, then sends Shutdown); a
    SIGTERM that finds the server gone ends the worker. False when the server is already gone
    (it died before the death signal was set, so the kernel will never send it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None if os.getppid() == parent else os._exit(0))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's parent check still ends the worker
    return os.getppid() == parent


class Worker:
    def __init__(
        self, core: EngineCore, commands: zmq.Socket, events: zmq.Socket, parent: int
    ) -> None:
        self.core = core
        self.commands = commands
        self.events = events
        self.parent = parent  # the server's pid, as it told us (not whoever is our parent now)
        self.codec = wire.Codec(wire.Command)

    def send(self, message: wire.Message) -> None:
        self.events.send(self.codec.encode(message), copy=False)

    def _read(self, timeout_ms: int) -> tuple[list[EngineRequest], list[str], bool]:
        adds: list[EngineRequest] = []
        aborts: list[str] = []
        stop = False
        if self.commands.poll(timeout_ms) == 0:
            return adds, aborts, stop
        while True:
            try:
                frame = self.commands.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return adds, aborts, stop
            message = self.codec.decode(frame.buffer)
            if isinstance(message, wire.Submit):
                adds += message.requests
            elif isinstance(message, wire.Abort):
                aborts += message.request_ids
            elif isinstance(message, wire.Shutdown):
                stop = True

    def serve(self) -> None:
        core = self.core
        while True:
            adds, aborts, stop = self._read(0 if core.has_work() else IDLE_POLL_MS)
            if stop:
                core.close()
                return
            if os.getppid() != self.parent:
                log.warning("the server process has gone: exiting")
                core.close()
                return
            if not (adds or aborts or core.has_work()):
                continue
            outputs = core.apply(adds, aborts)
            if core.has_work():
                outputs += core.safe_step()
            self.send(wire.StepOutputs(outputs=outputs, stats=core.stats()))


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    parent = args.parent_pid or os.getppid()
    configure_logging(args.log_level, args.log_format, "[worker]")
    if not follow_parent(parent):
        log.warning("the server (pid %d) was gone before this worker started: exiting", parent)
        return 0
    config = EngineConfig(**json.loads(args.config))
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    events = ctx.socket(zmq.PUSH)
    for sock in (commands, events):
        sock.setsockopt(zmq.LINGER, 2000)
    commands.connect(args.commands)
    events.connect(args.events)
    codec = wire.Codec(wire.Command)
    try:
        from probserve.engine.core.host import start_engine

        log.info("loading %s", args.model)
        engine = start_engine(args.model, config, draft=args.draft_model)
        worker = Worker(engine.core, commands, events, parent)
        elapsed = time.monotonic() - started
        log.info("engine worker ready in %.1f s (%d torch threads)", elapsed, engine.threads)
        hello = wire.Hello(
            info=engine.core.info,
            model=engine.source.directory,
            pid=os.getpid(),
            startup_seconds=elapsed,
            tokenizer=engine.tokenizer_class,
        )
        worker.send(hello)
        worker.serve()
        return 0
    except BaseException as exc:
        from probserve.models.sources import ModelLoadError

        if isinstance(exc, ModelLoadError):  # the user's model, not a bug: one line
            reason = str(exc)
            log.critical("%s", reason)
        else:
            reason = f"engine stopped: {type(exc).__name__}: {exc}"
            log.critical("%s", reason, exc_info=exc)
        events.send(codec.encode(wire.Failed(reason=reason)))
        return 1
    finally:
        commands.close()
        events.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
