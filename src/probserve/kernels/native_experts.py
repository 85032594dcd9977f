"""A layer's experts as one native call (layer.cpp's ps_experts), for a forward that calls its
layers one at a time (the hybrid families', Gemma 4's, --op-by-op): the experts walked in C++
as ps_layers walks a mixture, so a token's output is the same bits as kernels/experts.py's loop
(EachExpert), without the Python and OpenMP forks that loop spends on each expert. The loop
stays for an activation the library does not have."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from probserve.kernels.experts import Activation, EachExpert, Expert
from probserve.kernels.native_structs import PsExperts, PsProj, check_struct_sizes, describe_proj

# an activation as ps_experts takes it: (alpha, limit, gelu), or None where it has none
NativeActivation = Callable[[Activation], "tuple[float, float, int] | None"]


@dataclass(frozen=True)
class DescribedExperts:
    """A layer's experts as the library reads them: each one's [gate | up] (2 inter rows) and
    down (hidden rows) as its packed parts."""

    gate_up: ctypes.Array[PsProj]
    down: ctypes.Array[PsProj]
    inter: int
    hidden: int


def describe_experts(experts: Sequence[Expert]) -> DescribedExperts:
    """Every expert's projections described in place (pointers into the tensors the experts
    hold: they must outlive the description)."""
    n = len(experts)
    gate_up = (PsProj * n)(*(describe_proj(e.gate_up.weights) for e in experts))
    down = (PsProj * n)(*(describe_proj(e.down.weights) for e in experts))
    inter = gate_up[0].n // 2 if n else 0
    hidden = down[0].n if n else 0
    if any(
        g.n != 2 * inter or g.parts[0].k != hidden or d.n != hidden or d.parts[0].k != inter
        for g, d in zip(gate_up, down, strict=True)
    ):
        raise ValueError("a layer's experts do not share one shape")
    return DescribedExperts(gate_up, down, inter, hidden)


class NativeExperts:
    """A layer's experts (kernels/layer_ops.py's `Experts`) run by one ps_experts call."""

    def __init__(
        self, lib: ctypes.CDLL, experts: Sequence[Expert], activation: NativeActivation
    ) -> None:
        """`lib`: the kernels' library; `activation`: the backend's activation as ps_experts
        takes it (InvariantKernels.native_activation)."""
        check_struct_sizes(lib)
        self.lib = lib
        self.each = EachExpert(tuple(experts))
        self.described = describe_experts(self.each.experts)
        self._activation = activation

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: Activation
    ) -> torch.Tensor:
        """As EachExpert: rows x [T, H] routed to experts ids [T, k] with weights [T, k] ->
        each token's sum over its experts e of w_e * down_e(act(gate_up_e(x)))."""
        d = self.described
        kind = self._activation(act)
        if (
            kind is None
            or x.dtype != torch.float32
            or weights.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] != d.hidden
            or ids.shape != weights.shape
            or ids.dim() != 2
            or ids.shape[0] != x.shape[0]
        ):
            return self.each(x, ids, weights, act)
        t, k = ids.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if t == 0:
            return out
        ids = ids.to(torch.int64).contiguous()
        if int(ids.min()) < 0 or int(ids.max()) >= len(d.gate_up):
            raise IndexError("experts: a token is routed to an expert the layer lacks")
        x, weights = x.contiguous(), weights.contiguous()
        alpha, limit, gelu = kind
        spec = PsExperts(len(d.gate_up), d.inter, d.hidden, d.gate_up, d.down, alpha, limit, gelu)
        scratch = torch.empty(
            int(self.lib.ps_experts_scratch(ctypes.byref(spec), t, k)), dtype=torch.float32
        )
        self.lib.ps_experts(
            ctypes.byref(spec), x.data_ptr(), t, ids.data_ptr(), weights.data_ptr(), k,
            out.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        return out
