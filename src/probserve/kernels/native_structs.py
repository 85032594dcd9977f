"""The ctypes mirrors of the structs the kernels' library reads (kernels/probserve.h: PsPart,
PsProj, PsMoE, PsLayer, PsModel, PsStep, PsExperts), the description of a projection's packed
parts as a PsProj, and the check, when the library loads, that each mirror is the size of its
struct."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from probserve.kernels.build import KernelBuildError, header_constant
from probserve.kernels.weights import Packed, QuantizedWeight

MAX_PARTS = header_constant("PS_MAX_PARTS")  # probserve.h's, as layer.cpp has it
_I = ctypes.c_int64
_P = ctypes.c_void_p
_F = ctypes.c_float


class PsPart(ctypes.Structure):
    _fields_ = [("fmt", _I), ("data", _P), ("bias", _P), ("n", _I), ("k", _I)]


class PsProj(ctypes.Structure):
    _fields_ = [("nparts", _I), ("parts", PsPart * MAX_PARTS), ("n", _I)]


class PsMoE(ctypes.Structure):
    _fields_ = [
        ("router", PsProj),
        *((name, _I) for name in ("experts", "top_k", "norm", "inter")),
        ("gate_up", ctypes.POINTER(PsProj)),
        ("down", ctypes.POINTER(PsProj)),
        ("index", _I),
    ]


class PsLayer(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("ln1", "ln2", "pre_ff", "post_ff", "q_norm", "k_norm")),
        *((name, PsProj) for name in ("qkv", "o", "gate_up", "down")),
        ("window", _I),
        ("rope", _I),
        ("moe", ctypes.POINTER(PsMoE)),
        ("sinks", _P),
    ]


class PsModel(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("layers", "hidden", "nq", "nkv", "d", "inter")),
        *((name, _F) for name in ("eps", "scale", "softcap", "alpha", "limit")),
        ("sandwich", _I),
        ("gelu", _I),
        ("qk_full", _I),
        ("layer", ctypes.POINTER(PsLayer)),
    ]


class PsStep(ctypes.Structure):
    _fields_ = [
        ("tokens", _I),
        ("pos", _P),
        ("slots", _P),
        ("tables", _P),
        ("width", _I),
        ("block_size", _I),
        ("seq", _P),
        ("len", _P),
        ("kc", _P),
        ("vc", _P),
        ("cache_slots", _I),
        ("cos", ctypes.POINTER(_P)),
        ("sin", ctypes.POINTER(_P)),
        ("routed", _P),
        ("routed_w", _P),
        ("moe_layers", _I),
        ("top_k", _I),
    ]


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe_proj(parts: Sequence[Packed]) -> PsProj:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a projection has 1 to {MAX_PARTS} parts, not {len(parts)}")
    if len({p.k for p in parts}) != 1:
        raise ValueError("a projection's parts must share their input size")
    proj = PsProj(nparts=len(parts), n=sum(p.n for p in parts))
    for i, p in enumerate(parts):
        if isinstance(p, QuantizedWeight):
            proj.parts[i] = PsPart(p.fmt, p.data.data_ptr(), ptr(p.bias), p.n, p.k)
        else:
            proj.parts[i] = PsPart(-1, p.panels.data_ptr(), ptr(p.bias), p.n, p.k)
    return proj


class PsExperts(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("experts", "inter", "hidden")),
        ("gate_up", ctypes.POINTER(PsProj)),
        ("down", ctypes.POINTER(PsProj)),
        ("alpha", _F),
        ("limit", _F),
        ("gelu", _I),
    ]


STRUCTS = (PsPart, PsProj, PsLayer, PsModel, PsStep, PsMoE, PsExperts)  # ps_struct_sizes' order


def check_struct_sizes(lib: ctypes.CDLL) -> None:
    """The library's structs (probserve.h) are the size of their ctypes mirrors here: a field
    added on one side only would pass pointers to the wrong places."""
    sizes = (ctypes.c_int64 * len(STRUCTS))()
    lib.ps_struct_sizes(sizes)
    ours = [ctypes.sizeof(t) for t in STRUCTS]
    if list(sizes) != ours:
        raise KernelBuildError(
            f"the kernels' structs ({list(sizes)} bytes) differ from kernels/native_structs.py's "
            f"({ours}): probserve.h and its mirrors must change together"
        )
