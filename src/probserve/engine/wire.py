"""The engine wire protocol: how an API server and an engine worker talk, version 1.

Messages are msgpack (msgspec), one per ZeroMQ frame, on two one-way sockets: the server PUSHes
commands to the worker, the worker PUSHes events back. Every message is a tagged struct whose
first field is `v`, the protocol version; a peer that reads another version refuses it. Numpy
arrays (the logprobs) travel as msgpack extension 1: a 16-byte header (dtype string, rank) and
the shape, then the raw little-endian bytes; never per-token Python objects or JSON.

Server -> worker: Submit (requests to queue), Abort (request ids), Shutdown.
Worker -> server: Hello (once, when the model is loaded and warmed up: what it serves),
StepOutputs (after every engine step, possibly with no outputs: the step's news and the engine's
figures), Failed (the worker is about to exit after an unexpected error).

docs/engine-protocol.md describes each field; tests/test_worker.py checks round trips.
"""

from __future__ import annotations

import msgspec
import numpy as np

from probserve.engine.info import EngineInfo
from probserve.engine.stats import EngineStats
from probserve.engine.types import EngineOutput, EngineRequest

VERSION = 2  # 2: StepOutputs.stats is an EngineStats (1: a dict of floats)
_NDARRAY = 1  # msgpack extension code of a numpy array


class ProtocolError(RuntimeError):
    """A message this side cannot read (another protocol version, or garbage)."""


class Message(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    v: int = VERSION


class Submit(Message, tag="submit"):
    requests: list[EngineRequest]


class Abort(Message, tag="abort"):
    request_ids: list[str]


class Shutdown(Message, tag="shutdown"):
    pass


class Hello(Message, tag="hello"):
    info: EngineInfo
    model: str  # what the worker loaded, as a --model spec (a GGUF's converted directory)
    pid: int
    startup_seconds: float  # from process start to ready (load, runner build, warm-up)
    # the tokenizer's class as AutoTokenizer chose it ("module:qualname"), so the server loads
    # the same one without AutoTokenizer, which loads torch (models/loader.py: load_tokenizer)
    tokenizer: str = ""


class StepOutputs(Message, tag="step"):
    outputs: list[EngineOutput]
    stats: EngineStats


class Failed(Message, tag="failed"):
    reason: str


Command = Submit | Abort | Shutdown
Event = Hello | StepOutputs | Failed


def _enc_hook(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        header = dtype.str.encode().ljust(8) + a.ndim.to_bytes(8, "little")
        shape = np.asarray(a.shape, dtype="<i8").tobytes()
        return msgspec.msgpack.Ext(_NDARRAY, header + shape + a.astype(dtype, copy=False).tobytes())
    # msgspec's protocol: a hook raises NotImplementedError for a type it does not handle
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> object:
    if code != _NDARRAY:
        raise ProtocolError(f"unknown msgpack extension {code}")
    dtype = np.dtype(bytes(data[:8]).strip().decode())
    ndim = int.from_bytes(data[8:16], "little")
    shape = tuple(int(x) for x in np.frombuffer(data[16 : 16 + 8 * ndim], dtype="<i8"))
    # a copy: the frame's buffer is not ours to keep
    return np.frombuffer(data[16 + 8 * ndim :], dtype=dtype).reshape(shape).copy()


def _dec_hook(kind: type, obj: object) -> object:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {kind}")


class Codec:
    """Encodes any message; decodes the messages one side receives (`Command` or `Event`)."""

    def __init__(self, receives: object) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(receives, dec_hook=_dec_hook, ext_hook=_ext_hook)

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Message:
        try:
            message = self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"unreadable engine message: {exc}") from exc
        if message.v != VERSION:
            raise ProtocolError(
                f"engine protocol version {message.v} received; this side speaks {VERSION}"
            )
        return message
