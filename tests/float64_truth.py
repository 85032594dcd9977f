"""The ground truth of the exactness tests: prompt logprobs from a float64 forward of the same
(dequantized) weights, against probserve's deterministic engine and transformers' float32
forward (the float32 reference). Run as a script (`python tests/float64_truth.py`), it prints
one JSON line per prompt: each side's max |logprob - float64| and their max distance, and the
products in effect (its argument: `float`, the default, or `limbs`). It runs in a process of its
own so that `PROBSERVE_KERNEL_ISA` picks the kernels' ISA path (tests/test_exactness.py runs it
once per path the CPU has, with each product)."""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

PROMPTS = {
    # the worst case: its third token (id 1296) drifted 1.27e-4 on AVX-512
    "counting": "one two three, one two three, one two three, one two",
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived "
    "an old woodcutter and his daughter. Every morning they walked together to the river.",
    "hobbit": "In a hole in the ground there lived a hobbit. Not a nasty,",
    "digits": "3.14159265358979323846264338327950288419716939937510",
}


# The float32 reference's error is not one number: its BLAS sums each product in an order set by
# how it blocks the work over its threads, and the error at one token moves with that order (the
# counting prompt's worst token: 9.3e-6 on one thread, 2.4e-5 on two, on an Intel Xeon). The
# reference is run in each order and its error taken as the worst of them, per token.
REFERENCE_THREADS = (1, 2, 4)


def float64_model(m32: Any) -> Any:
    """A float64 copy where every operation is float64: transformers' RMSNorm casts its input
    to float32 whatever the model's dtype, so its norms become the same formula in float64.
    (RoPE's cos/sin stay as the model defines them.)"""
    m64 = copy.deepcopy(m32).double()

    def rms64(self: Any, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (x * scale)

    for mod in m64.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = rms64.__get__(mod)
    return m64


class Float64Everywhere(TorchFunctionMode):
    """Inside it, every conversion to float32 a model's code writes (`x.float()`,
    `.to(torch.float32)`, `dtype=torch.float32`) is one to float64: the newer families cast
    inside more than their norms (Qwen3.5's gated norm, its delta rule's float32 copies, the
    routers' softmax, Gemma 4's), and a float64 truth must not round through float32 there."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def truth_everywhere(m32: Any, ids: list[int]) -> np.ndarray:
    """The float64 truth of a model whose code casts to float32 anywhere (Float64Everywhere);
    a mixture of experts' experts one by one (torch's grouped product has no float64)."""
    m64 = copy.deepcopy(m32).double()
    m64.config._experts_implementation = "eager"
    with Float64Everywhere():
        return reference_logprobs(m64, ids)


@torch.inference_mode()
def reference_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return np.array([float(lp[j - 1, ids[j]]) for j in range(1, len(ids))])


def engine_logprobs(core: Any, rid: str, ids: list[int]) -> np.ndarray:
    from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams

    req = EngineRequest(rid, tuple(ids), SamplingParams(temperature=0, max_tokens=0),
                        LogprobsSpec(prompt_top_k=0))  # fmt: skip
    core.add_request(req)
    rows = []
    while core.has_work():
        rows += [o.prompt_logprobs for o in core.step() if o.prompt_logprobs is not None]
    return np.concatenate([np.asarray(r.logprobs, np.float64) for r in rows])


def measure(products: str) -> list[dict[str, Any]]:
    from probserve.engine import EngineConfig, EngineCore
    from probserve.models import load_model

    float32 = load_model()  # the GGUF dequantized, as transformers loads it
    m64 = float64_model(float32.model)
    config = EngineConfig(kv_cache_gib=0.1, products=products)  # type: ignore[arg-type]
    core = EngineCore(load_model(None, "native"), config)
    assert core.info.deterministic, "the deterministic kernels did not build"
    out = []
    for name, text in PROMPTS.items():
        ids = float32.tokenizer(text).input_ids
        out.append(compare(core, float32.model, name, ids, reference_logprobs(m64, ids)))
    return out


def compare(core: Any, m32: Any, name: str, ids: list[int], truth: np.ndarray) -> dict[str, Any]:
    """One prompt's row: the engine's and the float32 reference's errors against `truth`
    (the reference's the worst of its summation orders, per token) and how far apart they are."""
    ours = engine_logprobs(core, name, ids)
    refs = []  # the float32 reference in each of its summation orders (its BLAS's blocking)
    threads_before = torch.get_num_threads()
    for threads in REFERENCE_THREADS:
        torch.set_num_threads(threads)
        refs.append(reference_logprobs(m32, ids))
    torch.set_num_threads(threads_before)
    errors = [np.abs(ref - truth) for ref in refs]
    return {
        "prompt": name,
        "probserve": float(np.abs(ours - truth).max()),
        "reference": max(float(e.max()) for e in errors),
        "references": [float(e.max()) for e in errors],
        "apart": max(float(np.abs(ours - ref).max()) for ref in refs),
        # every token's error, for the pooled root-mean-square of the whole set
        "probserve_errors": np.abs(ours - truth).tolist(),
        "reference_errors": np.maximum.reduce(errors).tolist(),
        "products": core.info.products,
        "kernel_isa": core.info.kernel_isa,
    }  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    for row in measure(sys.argv[1] if len(sys.argv) > 1 else "float"):
        print(json.dumps(row))
    sys.stdout.flush()
