"""The prefix cache on disk (`--prefix-cache-dir`): full KV blocks kept past their memory and past
a restart, read back by their hash, the same bits as computing them again.

A cached block (block_pool.py) is written when the pool evicts it from memory, and every cached
block at shutdown (`close`), most recently used first. A lookup the memory cache misses asks the
disk before computing: a block found there is read into a fresh block of the KV cache and
registered as if it had been computed. One file a block:

    DIR/<fingerprint id>/<hash[:2]>/<hash>.kv
    magic (8 bytes) | header length (u32) | header (JSON: fingerprint, hash, tokens, tensors)
    | the tensors' bytes (K, V, the hidden states, a mixture of experts' routing) | CRC-32 (u32)

The key carries the numerics fingerprint (engine/fingerprint.py) twice: in the folder, and in
the header, checked on reading with the hash, the tokens and the tensors' shapes; a block made
by other arithmetic is never read. Files are written to a temporary name and renamed into place
(two servers on one directory never see half of one; both write the same bits for one name).
A file that fails any check (torn, truncated, garbage, another fingerprint's) is skipped,
counted and deleted; files that are not blocks' are counted once and left alone.
The directory is bounded by `--prefix-cache-disk-gib` over every fingerprint's blocks: past it
the least recently used (by modification time, which a read refreshes, so every server's use
counts) are deleted, down to 90% of the budget, after a fresh look at the directory.
Writes run on a thread of their own (a bounded queue: blocks beyond it are dropped and counted),
so a step never waits for the disk; reads run where the lookup is, in the scheduler's step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from probserve.engine.prefix_hash import BlockHash

if TYPE_CHECKING:
    from probserve.engine.core.block_pool import BlockPool
    from probserve.models.llama import KVCache

log = logging.getLogger(__name__)

MAGIC = b"PSKV\x00\x01\r\n"
SUFFIX = ".kv"
_HEAD = struct.Struct("<8sI")
_CRC = struct.Struct("<I")
_STALE_TMP_S = 600.0  # a temporary file this old is a crashed writer's
PENDING_BYTES = 256 << 20  # blocks waiting for the writer thread, at most

Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name: (numpy dtype, shape)
Arrays = dict[str, np.ndarray]


class KVBlocks:
    """One block's tensors in a runner's KV cache (models/llama.py: KVCache), copied out or in."""

    def __init__(self, cache: Callable[[], KVCache]) -> None:
        self._cache = cache

    def _views(self, block: int) -> dict[str, torch.Tensor]:
        c = self._cache()
        s = slice(block * c.block_size, (block + 1) * c.block_size)
        views: dict[str, torch.Tensor] = {}
        for name, kv in (("k", c.k), ("v", c.v)):
            if isinstance(kv, list):  # one tensor per cache layer (layers of other shapes)
                views |= {f"{name}{i}": layer[s] for i, layer in enumerate(kv)}
            else:
                views[name] = kv[:, s]
        views["hidden"] = c.hidden[s]
        if c.experts is not None and c.expert_weights is not None:
            views["experts"], views["expert_weights"] = c.experts[s], c.expert_weights[s]
        return views

    def layout(self) -> Layout:
        return {
            name: (str(t.cpu()[:0].numpy().dtype), tuple(t.shape))
            for name, t in self._views(1).items()
        }

    def read(self, block: int) -> Arrays:
        return {
            name: np.array(t.cpu().numpy(), order="C") for name, t in self._views(block).items()
        }

    def write(self, block: int, arrays: Mapping[str, np.ndarray]) -> None:
        for name, t in self._views(block).items():
            if t.device.type == "cpu":  # numpy's copy: one thread, no parallel region to wait on
                t.numpy()[...] = arrays[name]
            else:
                t.copy_(torch.from_numpy(arrays[name]))


def encode(fingerprint: str, h: BlockHash, tokens: tuple[int, ...], arrays: Arrays) -> bytes:
    header = json.dumps({
        "fingerprint": fingerprint, "hash": h.hex(), "tokens": list(tokens),
        "tensors": [[n, str(a.dtype), list(a.shape)] for n, a in arrays.items()],
    }).encode()  # fmt: skip
    parts = [_HEAD.pack(MAGIC, len(header)), header, *(a.tobytes() for a in arrays.values())]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode(
    data: bytes | bytearray, fingerprint: str, h: BlockHash, tokens: tuple[int, ...], layout: Layout
) -> Arrays | None:
    """The block's tensors, or None where any check fails (the magic, the lengths, the CRC, the
    fingerprint, the hash, the tokens, the tensors' names, types and shapes)."""
    if len(data) < _HEAD.size + _CRC.size or data[:8] != MAGIC:
        return None
    (n,) = struct.unpack_from("<I", data, 8)
    end = len(data) - _CRC.size
    if _HEAD.size + n > end or _CRC.unpack_from(data, end)[0] != zlib.crc32(data[:end]):
        return None
    try:
        header = json.loads(data[_HEAD.size : _HEAD.size + n])
        tensors = [(str(t[0]), str(t[1]), tuple(int(x) for x in t[2])) for t in header["tensors"]]
        ok = (
            header["fingerprint"] == fingerprint and header["hash"] == h.hex()
            and tuple(header["tokens"]) == tuple(tokens)
            and tensors == [(name, dt, shape) for name, (dt, shape) in layout.items()]
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if not ok:
        return None
    out: Arrays = {}
    at = _HEAD.size + n
    for name, dt, shape in tensors:
        size = int(np.prod(shape)) * np.dtype(dt).itemsize
        if at + size > end:
            return None
        out[name] = np.frombuffer(data, dtype=dt, count=int(np.prod(shape)), offset=at).reshape(
            shape
        )
        at += size
    return out if at == end else None


class DiskCache:
    """The block files of one fingerprint in `directory`, within `budget` bytes (all of the
    directory's blocks, every fingerprint's)."""

    def __init__(self, directory: Path, budget: int, fingerprint: str, blocks: KVBlocks) -> None:
        self.root = directory
        self.budget = budget
        self.fingerprint = fingerprint
        self.folder = directory / fingerprint
        self.blocks = blocks
        self._layout: Layout | None = None
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "writes": 0, "skipped": 0, "evictions": 0, "dropped": 0}
        self._foreign: set[Path] = set()
        self._index: OrderedDict[Path, int] = OrderedDict()  # the writer's: path -> bytes
        self._total = 0
        self._pending = 0
        self._closed = False
        self._jobs: queue.Queue[tuple[BlockHash, tuple[int, ...], Arrays] | None] = queue.Queue()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="disk-cache", daemon=True)
        self._writer.start()

    # ---- the engine's side ----------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def path(self, h: BlockHash) -> Path:
        x = h.hex()
        return self.folder / x[:2] / (x + SUFFIX)

    def restore(self, block: int, h: BlockHash, tokens: tuple[int, ...]) -> bool:
        """Block `h` read from disk into `block` of the KV cache, if a file holds it whole."""
        path = self.path(h)
        try:
            with path.open("rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
        except OSError:
            return False
        del data[got:]
        if self._layout is None:
            self._layout = self.blocks.layout()
        arrays = decode(data, self.fingerprint, h, tokens, self._layout)
        if arrays is None:
            log.warning("prefix cache: %s is not a whole block of this fingerprint: deleted", path)
            self._count("skipped")
            path.unlink(missing_ok=True)
            return False
        self.blocks.write(block, arrays)
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last to be deleted
        self._count("hits")
        return True

    def has(self, h: BlockHash) -> bool:
        return self.path(h).is_file()

    def spill(self, block: int, h: BlockHash, tokens: tuple[int, ...], wait: bool = False) -> None:
        """Block `block` (cached under `h`) copied now, written by the writer thread; dropped
        and counted where the blocks waiting already take PENDING_BYTES (unless `wait`)."""
        if self._closed:
            return
        with contextlib.suppress(OSError):  # on disk already (read back, or another server's)
            os.utime(self.path(h))  # used now
            return
        arrays = self.blocks.read(block)
        size = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if not wait and self._pending + size > PENDING_BYTES:
                self.counts["dropped"] += 1
                return
            self._pending += size
        self._jobs.put((h, tokens, arrays))

    def close(self, pool: BlockPool, seconds: float = 10.0) -> None:
        """Every block the pool caches written (the most recently used first, for at most
        `seconds`), then the writer stopped (its figures kept; a second call does nothing)."""
        if self._closed:
            return
        deadline = time.monotonic() + seconds
        for block, h, tokens in pool.cached_blocks():
            if time.monotonic() > deadline:
                break
            while self._pending > PENDING_BYTES and time.monotonic() < deadline:
                time.sleep(0.01)  # the writer behind: no more than that many copies held
            if not self.has(h):
                self.spill(block, h, tokens, wait=True)
        self._closed = True
        self._jobs.put(None)
        self._writer.join(timeout=max(1.0, deadline - time.monotonic()))

    def flush(self) -> None:
        """Wait until every block handed to the writer is on disk."""
        self._jobs.join()

    def figures(self) -> dict[str, Any]:
        """EngineStats' prefix_cache_disk_* figures."""
        with self._lock:
            c = dict(self.counts)
            c["bytes"] = self._total
        return {f"prefix_cache_disk_{k}": v for k, v in c.items()}

    # ---- the writer thread -----------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                h, tokens, arrays = job
                try:
                    self._write(h, tokens, arrays)
                except OSError as exc:
                    log.warning("prefix cache: could not write a block (%s)", exc)
                    self._count("dropped")
                finally:
                    with self._lock:
                        self._pending -= sum(a.nbytes for a in arrays.values())
            finally:
                self._jobs.task_done()

    def _write(self, h: BlockHash, tokens: tuple[int, ...], arrays: Arrays) -> None:
        path = self.path(h)
        if path.is_file():  # another server (or an earlier run) wrote it: used now
            os.utime(path)
            if path in self._index:
                self._index.move_to_end(path)
            return
        data = encode(self.fingerprint, h, tokens, arrays)
        if len(data) > self.budget:
            self._count("dropped")
            return
        self._make_room(len(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._index[path] = len(data)
        with self._lock:
            self._total += len(data)
            self.counts["writes"] += 1

    def _make_room(self, size: int) -> None:
        """Room for `size` more bytes: past the budget, the directory looked at afresh (other
        servers' blocks and reads count) and the least recently used deleted, to 90% of it."""
        if self._total + size <= self.budget:
            return
        self._scan()
        target = min(self.budget - size, int(self.budget * 0.9))
        while self._index and self._total > target:
            path, n = self._index.popitem(last=False)
            path.unlink(missing_ok=True)
            with self._lock:
                self._total -= n
                self.counts["evictions"] += 1

    def _scan(self) -> None:
        """The index rebuilt from the directory: every fingerprint's block files, oldest first;
        a crashed writer's temporary files deleted; anything else counted once, left alone."""
        found: list[tuple[float, Path, int]] = []
        now = time.time()
        for path, depth in self._walk():
            try:
                st = path.stat(follow_symlinks=False)
            except OSError:
                continue
            name = path.name
            if name.startswith(".tmp-") and depth == 2:
                if now - st.st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
            elif depth == 2 and _is_block_name(name) and path.parent.name == name[:2]:
                found.append((st.st_mtime, path, st.st_size))
            elif path not in self._foreign:
                self._foreign.add(path)
                self._count("skipped")
        found.sort()
        self._index = OrderedDict((p, n) for _, p, n in found)
        with self._lock:
            self._total = sum(n for _, _, n in found)

    def _walk(self) -> list[tuple[Path, int]]:
        """The directory's files with their depth: 2 for <fingerprint>/<xx>/<file>, where
        blocks are (folders deeper are no block's, and not looked into)."""
        out: list[tuple[Path, int]] = []
        stack = [(self.root, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if depth < 2:
                        stack.append((Path(e.path), depth + 1))
                else:
                    out.append((Path(e.path), depth))
        return out


def _is_block_name(name: str) -> bool:
    stem = name[: -len(SUFFIX)]
    return name.endswith(SUFFIX) and len(stem) == 64 and all(c in "0123456789abcdef" for c in stem)


def attach(
    pool: BlockPool, directory: str | None, gib: float, fingerprint: str,
    cache: Callable[[], KVCache],
) -> DiskCache | None:  # fmt: skip
    """A disk cache under `directory` for `pool`'s blocks, hooked into its evictions and misses
    (None where no directory is given or the pool caches nothing)."""
    if not directory or not pool.prefix_caching:
        return None
    try:
        disk = DiskCache(
            Path(directory).expanduser(), int(gib * 2**30), fingerprint, KVBlocks(cache)
        )
    except OSError as exc:
        log.warning(
            "--prefix-cache-dir %s cannot be used (%s): no prefix cache on disk", directory, exc
        )
        return None
    pool.disk = disk
    log.info(
        "prefix cache on disk: %s (%d blocks of this fingerprint, %.2f of %.2f GiB used)",
        disk.folder, sum(1 for p in disk._index if p.parent.parent == disk.folder),
        disk._total / 2**30, gib,
    )  # fmt: skip
    return disk
