"""GGUF block formats as kernels/quantized.cpp reads them: the formats' tables and the packing
of a tensor's rows of blocks into panels (numpy alone: no torch, no library); `pack_limbs`, the
panels of kernels/limbs.cpp (its own order, described there).

A [N, K] weight becomes panels of P output columns (P = the library's panel width, NR); in a
panel, for each block of `qk` weights along K: the float16 fields of the P columns (d, then Q4_1
and Q5_1's m or the K-quants' dmin: column c's two bytes at 2c), the K-quants' per-sub-block
scale bytes as the file holds them (byte i of column c at i * P + c: Q4_K and Q5_K's twelve
packed 6-bit scales and mins, Q6_K's sixteen int8 scales; MXFP4's one E8M0 byte, its block
having no float16 field), then `qk` rows of P quants, one row
per k: 8-bit formats one byte a column; the others the low nibbles two columns a byte (byte j
holds column j in its low nibble and column j + P/2 in its high one). The 5- and 6-bit formats'
quants sit in 32-bit lanes instead: per sub-block (32 k's; Q6_K's 16) and per half of the panel
(columns [0, P/2) and [P/2, P)), 5 (Q6_K: 3) vectors of P/2 uint32s, column c's quants side by
side in the bits of its lanes (k j at bit 5 j or 6 j), so that a k's quant is a shift and a mask
of a lane (two of them where it straddles two). No value changes, only places: a panel holds
exactly the file's bytes for its columns (P times the file's block size per block), and padded
columns are zeros (d = 0: weights 0; MXFP4's e = 0 is 2^-128 times zero quants' values: 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    name: str
    fmt: int  # quantized.cpp's Format id
    qk: int  # weights per block along K
    size: int  # the file's bytes per block
    halves: tuple[int, ...]  # offsets of the float16 fields in the file's block (d first)
    scales: tuple[int, int] | None  # the byte range of the scale bytes (K-quants; MXFP4's E8M0)
    bits: int  # bits per quant: 4, 5, 6 or 8


# GGML quantization type id -> its block format
FORMATS: dict[int, BlockFormat] = {
    2: BlockFormat("Q4_0", 0, 32, 18, (0,), None, 4),
    3: BlockFormat("Q4_1", 1, 32, 20, (0, 2), None, 4),
    8: BlockFormat("Q8_0", 2, 32, 34, (0,), None, 8),
    6: BlockFormat("Q5_0", 3, 32, 22, (0,), None, 5),
    7: BlockFormat("Q5_1", 4, 32, 24, (0, 2), None, 5),
    12: BlockFormat("Q4_K", 5, 256, 144, (0, 2), (4, 16), 4),
    13: BlockFormat("Q5_K", 6, 256, 176, (0, 2), (4, 16), 5),
    14: BlockFormat("Q6_K", 7, 256, 210, (208,), (192, 208), 6),
    39: BlockFormat("MXFP4", 8, 32, 17, (), (0, 1), 4),  # E8M0 scale byte | 16 bytes of E2M1
}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: weight j < 16 in byte j's low nibble, j >= 16 in byte
    j - 16's high one (Q4_0/Q4_1/Q5_0/Q5_1's qs)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def quants(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Blocks [..., size] -> each weight's unsigned quant [..., qk] (uint8, in the block's
    element order), unpacked as gguf's `dequantize_blocks` unpacks them; Q8_0: its int8 bytes."""
    lead = raw.shape[:-1]
    if ggml_type == 8:  # Q8_0: d | qs[32] int8
        return raw[..., 2:34]
    if ggml_type in (2, 3):  # Q4_0: d | qs[16]; Q4_1: d | m | qs[16]
        return _nibbles(raw[..., 2 if ggml_type == 2 else 4 :])
    if ggml_type == 39:  # MXFP4: e | qs[16], each nibble an index into the E2M1 values
        return _nibbles(raw[..., 1:17])
    if ggml_type in (6, 7):  # Q5_0: d | qh u32 | qs[16]; Q5_1: d | m | qh u32 | qs[16]
        at = 2 if ggml_type == 6 else 4
        # bit j: weight j
        high: np.ndarray = np.unpackbits(raw[..., at : at + 4], axis=-1, bitorder="little")
        return _nibbles(raw[..., at + 4 : at + 20]) | (high << 4)
    if ggml_type in (12, 13):  # Q4_K: d | dmin | scales[12] | qs[128]; Q5_K: ... | qh[32] | qs
        qs = raw[..., 16:144] if ggml_type == 12 else raw[..., 48:176]
        shift = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        # sub-block j (32 weights): bytes 32 (j // 2) .. + 32, low nibbles for even j
        q = ((qs.reshape(*lead, 4, 1, 32) >> shift) & 15).reshape(*lead, 256)
        if ggml_type == 13:  # weight 32 j + l: bit j of qh[l]
            bit = np.arange(8, dtype=np.uint8).reshape(8, 1)
            high = ((raw[..., 16:48].reshape(*lead, 1, 32) >> bit) & 1).reshape(*lead, 256)
            q = q | (high << 4)
        return q
    if ggml_type == 14:  # Q6_K: ql[128] | qh[64] | scales[16] int8 | d
        shift4 = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        shift2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        # weight 128 h + r: low 4 bits from ql[64 h + r % 64] >> 4 (r // 64), high 2 bits
        # from qh[32 h + r % 32] >> 2 (r // 32)
        low = ((raw[..., :128].reshape(*lead, 2, 1, 64) >> shift4) & 15).reshape(*lead, 256)
        high = ((raw[..., 128:192].reshape(*lead, 2, 1, 32) >> shift2) & 3).reshape(*lead, 256)
        return low | (high << 4)
    raise KeyError(f"no native kernel for GGML type {ggml_type}")


PACK_ROWS = 1024  # rows packed at a time: the unpacked quants of a chunk, not of a whole matrix


class BlockRows(Protocol):
    """Rows of blocks, uint8 [N, row bytes], taken a slice of rows at a time: an array, or rows
    where they lie in a file (models/gguf_blocks.FileRows), read slice by slice."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, rows: slice, /) -> np.ndarray: ...


def _in_chunks(
    blocks: np.ndarray | BlockRows, panel: int, pack: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """`pack` (rows of blocks -> their panels [ceil(rows / panel), nb, bytes]) over PACK_ROWS
    rows at a time, into one array: the same panels, with transients of a chunk's size (an 8B
    model's largest matrix would otherwise hold a gigabyte of them at load; rows in a file are
    read a chunk at a time, so its copy is never whole in memory beside the panels)."""
    n = blocks.shape[0]
    step = max(panel, PACK_ROWS // panel * panel)
    if n <= step:
        return pack(blocks[0:n])
    first = pack(blocks[:step])
    out = np.empty((-(-n // panel), *first.shape[1:]), dtype=np.uint8)
    out[: step // panel] = first
    for start in range(step, n, step):
        out[start // panel : -(-min(n, start + step) // panel)] = pack(blocks[start : start + step])
    return out


def pack_blocks(blocks: np.ndarray | BlockRows, ggml_type: int, panel: int) -> np.ndarray:
    """Rows of GGUF blocks, uint8 [N, K / qk * size] as the file holds them, packed into
    quantized.cpp's panels: uint8 [ceil(N / panel), K / qk, panel * size]."""
    return _in_chunks(blocks, panel, lambda rows: _pack_blocks(rows, ggml_type, panel))


def _pack_blocks(blocks: np.ndarray, ggml_type: int, panel: int) -> np.ndarray:
    f = FORMATS[ggml_type]
    p, half = panel, panel // 2
    n, row_bytes = blocks.shape
    nb = row_bytes // f.size
    raw = np.zeros((-(-n // p) * p, nb, f.size), dtype=np.uint8)
    raw[:n] = np.asarray(blocks).reshape(n, nb, f.size)
    panels = raw.shape[0] // p

    def by_panel(a: np.ndarray) -> np.ndarray:  # [rows, nb, ...] -> [panels, nb, P, ...]
        return a.reshape(panels, p, nb, *a.shape[2:]).swapaxes(1, 2)

    parts = [by_panel(raw[..., at : at + 2]).reshape(panels, nb, 2 * p) for at in f.halves]
    if f.scales is not None:  # byte i of column c at i * P + c
        lo, hi = f.scales
        parts.append(by_panel(raw[..., lo:hi]).swapaxes(2, 3).reshape(panels, nb, (hi - lo) * p))
    q = by_panel(quants(raw, ggml_type)).swapaxes(2, 3)  # [panels, nb, qk (k), P (column)]
    if f.bits in (5, 6):  # per sub-block, per half, a column's quants side by side in int32 lanes
        rows = _lane_fields(q, f.bits, panels, nb, half)
    elif f.bits == 8:
        rows = q
    else:
        rows = (q[..., :half] & 15) | ((q[..., half:] & 15) << 4)  # [panels, nb, qk, half]
    parts.append(rows.reshape(panels, nb, -1))
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    assert data.shape[-1] == p * f.size
    return data


def _lane_fields(q: np.ndarray, bits: int, panels: int, nb: int, half: int) -> np.ndarray:
    """The 5- and 6-bit formats' quants [panels, nb, qk (k), P] in their lanes: per sub-block (32
    k's; Q6_K's 16), per half of the panel, `bits` vectors of `half` little-endian uint32 lanes
    (Q6_K: 3), lane c of vector i holding bits 32 i .. 32 i + 31 of column c's quants side by side
    (k j's at bit `bits` j): [panels, nb, qk * bits * P / 8]."""
    sub = 16 if bits == 6 else 32
    subs = q.reshape(panels, nb, -1, sub, 2, half).astype(np.uint32)  # [.., k, h, c]
    words = np.zeros((*subs.shape[:3], 2, sub * bits // 32, half), dtype=np.uint32)  # [.., h, i, c]
    for j in range(sub):
        i, o = divmod(bits * j, 32)
        words[..., i, :] |= subs[:, :, :, j] << o
        if o + bits > 32:  # the bits past the lane's top, at the next one's bottom
            words[..., i + 1, :] |= subs[:, :, :, j] >> (32 - o)
    lanes = words.astype("<u4").view(np.uint8)
    return lanes.reshape(panels, nb, -1)


# the GGML types limbs.cpp multiplies in integer limbs: all but MXFP4
LIMB_TYPES = (2, 3, 8, 6, 7, 12, 13, 14)
LIMB_PANEL = 32  # limbs.cpp's panel width (columns), on every ISA


def _k_scales(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """The K-quants' per-sub-block scale bytes [..., 8 sub-blocks of 32, 2]: Q4_K and Q5_K's 6-bit
    sc and mn (get_scale_min_k4's unpacking of the 12 bytes), Q6_K's int8 scales of the sub-block's
    first and second 16 weights."""
    if ggml_type == 14:
        return raw[..., 192:208].reshape(*raw.shape[:-1], 8, 2)
    q = raw[..., 4:16]
    a, b, c = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return np.stack([sc, mn], axis=-1)


def limb_block_bytes(ggml_type: int) -> int:
    """Bytes of one block of a limb panel (32 columns by the format's block along K): the file's,
    plus the K-quants' unpacked scales (Q4_K, Q5_K: 16 bytes a column where the file packs 12)."""
    f = FORMATS[ggml_type]
    return 32 * (f.size + (4 if ggml_type in (12, 13) else 0))


def pack_limbs(blocks: np.ndarray | BlockRows, ggml_type: int, panel: int) -> np.ndarray:
    """Rows of GGUF blocks packed into limbs.cpp's panels (`panel` = 32 columns, two halves of
    16): uint8 [ceil(N / 32), K / qk, limb_block_bytes]. Per block: the float16 fields of the 32
    columns (d; then m or dmin), then per sub-block of 32 k's the K-quants' scale bytes (two rows of
    32: sc and mn, or Q6_K's two int8 scales), then per half the quants in vpdpbusd's order: chunks
    of 64 bytes holding 16 columns x 4 k's (byte 4j + i: column j's k 4c + i of chunk c); Q8_0
    eight chunks of int8 + 128; the others four chunks of nibbles (chunk i: chunk 2i's low bits
    in the low nibbles, 2i + 1's in the high ones) and their high bits: 5-bit one chunk (bit c:
    chunk c's bit 4), Q6_K two (bits 2j, 2j + 1 of chunk t: chunk 4t + j's bits 4 and 5)."""
    if ggml_type not in LIMB_TYPES or panel != LIMB_PANEL:
        raise ValueError(f"no limb layout for GGML type {ggml_type} in panels of {panel}")
    return _in_chunks(blocks, panel, lambda rows: _pack_limbs(rows, ggml_type, panel))


def _pack_limbs(blocks: np.ndarray, ggml_type: int, panel: int) -> np.ndarray:
    f = FORMATS[ggml_type]
    n, row_bytes = blocks.shape
    nb = row_bytes // f.size
    subs = f.qk // 32
    raw = np.zeros((-(-n // panel) * panel, nb, f.size), dtype=np.uint8)
    raw[:n] = np.asarray(blocks).reshape(n, nb, f.size)
    panels = raw.shape[0] // panel
    by_panel = raw.reshape(panels, panel, nb, f.size).swapaxes(1, 2)  # [panels, nb, 32, size]
    head = [by_panel[..., at : at + 2].reshape(panels, nb, 2 * panel) for at in f.halves]
    q = quants(raw, ggml_type).reshape(panels, panel, nb, f.qk).swapaxes(1, 2)  # [p, nb, col, k]
    if ggml_type == 8:
        q = q ^ np.uint8(128)  # int8 + 128 as an unsigned byte
    # [p, nb, col, k] -> [p, nb, sub, half, chunk (k // 4 in the sub-block), col 16, k % 4]
    q = q.reshape(panels, nb, 2, 16, subs, 8, 4).transpose(0, 1, 4, 2, 5, 3, 6)
    if f.bits < 8:
        low = q & 15
        parts = [low[:, :, :, :, 0::2] | (low[:, :, :, :, 1::2] << 4)]
        if f.bits > 4:  # chunk c's high bits at bit c (5-bit) or 2 (c % 4) (6-bit) of chunk c // g
            width = f.bits - 4
            g = 8 // width
            shape = (panels, nb, subs, 2, 8 // g, g, 16, 4)
            shift = (np.arange(g, dtype=np.uint8) * width).reshape(g, 1, 1)
            high = (q >> 4).reshape(shape) << shift
            parts.append(np.bitwise_or.reduce(high, axis=5))
        q = np.concatenate(parts, axis=4)
    quant_bytes = np.ascontiguousarray(q).reshape(panels, nb, subs, -1)
    if f.qk == 256:  # the scale rows: [p, nb, sub, 2, col]
        scales = _k_scales(by_panel, ggml_type).transpose(0, 1, 3, 4, 2)
        quant_bytes = np.concatenate([scales.reshape(panels, nb, subs, 2 * panel), quant_bytes], -1)
    data = np.concatenate([*head, quant_bytes.reshape(panels, nb, -1)], axis=-1)
    assert data.shape[-1] == limb_block_bytes(ggml_type)
    return np.ascontiguousarray(data)
