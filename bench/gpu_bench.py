"""The GPU path against transformers' generate, in the same run on the same GPU, at the shape
of Llama-3-8B (random weights built here: nothing to download), and the HBM roofline.

    .venv/bin/python bench/gpu_bench.py                 # the 8B shape, bf16 and exact paths
    .venv/bin/python bench/gpu_bench.py --layers 4      # a quicker, shallower model

Prints one line per measurement, `name value unit`, then the ratios the GPU issue asks for:
one stream's tokens/s against the roofline (the weights' bytes read once a token at the
measured copy bandwidth), 64 streams against transformers' generate at batch 64, the exact
path's cost against the bf16 path's, and one stream's decode replayed from CUDA graphs against
the same steps run eagerly (--no-cuda-graphs), and 64 streams sampled at temperature 1 (seeded:
each row drawn on the host) against 64 greedy ones. Every request asks for each token's logprob
and top 5 (the reductions on the GPU). Run by scripts/gpu_check.sh; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

SHAPE = {  # Llama-3-8B
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip


def random_model(layers: int, dtype: torch.dtype, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, eos_token_id=2, bos_token_id=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    # to_empty left the rotary module's inverse frequencies unset: a new one, on the device
    rotary = type(model.model.rotary_emb)
    model.model.rotary_emb = rotary(config).to(device)
    return model


def bandwidth(device: str) -> float:
    """Bytes a second one large device-to-device copy moves (read + write)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - start)


def hf_generate(model: Any, batch: int, prompt: int, new: int) -> float:
    """transformers' generate: tokens a second, greedy, `batch` sequences."""
    ids = torch.randint(3, 256, (batch, prompt), device=model.device)
    fixed = {"attention_mask": torch.ones_like(ids), "pad_token_id": 0, "do_sample": False}
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **fixed)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **fixed)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - start)


def engine_tokens(
    loaded: Any,
    precision: str,
    batch: int,
    prompt: int,
    new: int,
    graphs: bool = True,
    temperature: float = 0.0,
) -> tuple[float, dict[int, int]]:
    """The engine on the GPU path: tokens a second of `batch` greedy requests decoding together,
    each token's logprob and top 5 asked for (prefill excluded: timed from the step where every
    request has its first token), and the decode steps each CUDA graph bucket replayed."""
    from probserve.engine import (
        EngineConfig,
        EngineCore,
        EngineRequest,
        LogprobsSpec,
        SamplingParams,
    )

    config = EngineConfig(device="cuda", precision=precision, kv_cache_gib=8.0,  # type: ignore[arg-type]
                          max_num_seqs=max(batch, 1), max_num_batched_tokens=4096,
                          cuda_graphs=graphs)  # fmt: skip
    core = EngineCore(loaded, config)
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        ids = tuple(int(t) for t in torch.randint(3, 256, (prompt,), generator=g))
        sampling = SamplingParams(
            temperature=temperature, seed=i if temperature else None, max_tokens=new,
            ignore_eos=True,
        )  # fmt: skip
        core.add_request(EngineRequest(f"r{i}", ids, sampling, LogprobsSpec(top_k=5)))
    made = 0
    start = None
    while core.has_work():
        outs = core.step()
        if start is None and all(len(o.new_token_ids) for o in outs) and len(outs) == batch:
            torch.cuda.synchronize()
            start, made = time.perf_counter(), 0
            continue
        made += sum(len(o.new_token_ids) for o in outs)
    torch.cuda.synchronize()
    assert start is not None
    rate = made / (time.perf_counter() - start)
    replayed = getattr(core.runner, "graphs", None)
    return rate, dict(replayed.steps) if replayed is not None else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA GPU (torch sees none)")
    from probserve.models import LoadedModel

    print(f"gpu {torch.cuda.get_device_name()}")
    bw = bandwidth("cuda")
    print(f"copy_bandwidth {bw / 1e12:.2f} TB/s")
    hf = random_model(args.layers, torch.bfloat16, "cuda")
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    roofline = bw / weights
    print(f"weights_bf16 {weights / 1e9:.2f} GB")
    print(f"roofline_one_stream {roofline:.1f} tokens/s")
    peer = {b: hf_generate(hf, b, args.prompt, args.new) for b in (1, 64)}
    for b, v in peer.items():
        print(f"transformers_generate_batch{b} {v:.1f} tokens/s")
    del hf
    torch.cuda.empty_cache()
    host = random_model(args.layers, torch.float32, "cpu")  # the engine packs it to the GPU
    loaded = LoadedModel(model=host, tokenizer=None, name="8b-shape",  # type: ignore[arg-type]
                         eos_token_ids=frozenset({2}), context_length=8192,
                         vocab_size=SHAPE["vocab_size"])  # fmt: skip
    ours = {}
    for precision in ("bf16", "exact"):
        for b in (1, 64):
            ours[precision, b], steps = engine_tokens(loaded, precision, b, args.prompt, args.new)
            print(f"probserve_{precision}_streams{b} {ours[precision, b]:.1f} tokens/s")
            print(f"decode_graph_steps_{precision}_streams{b} {steps} bucket:steps")
            torch.cuda.empty_cache()
    eager, _ = engine_tokens(loaded, "bf16", 1, args.prompt, args.new, graphs=False)
    print(f"probserve_bf16_streams1_eager {eager:.1f} tokens/s")
    # seeded sampling at temperature 1 (an RL rollout's): each row drawn on the host
    sampled, _ = engine_tokens(loaded, "bf16", 64, args.prompt, args.new, temperature=1.0)
    print(f"probserve_bf16_streams64_sampled {sampled:.1f} tokens/s")
    print(f"ratio_one_stream_bf16_to_roofline {ours['bf16', 1] / roofline:.2f}")
    print(f"ratio_64_streams_bf16_to_transformers {ours['bf16', 64] / peer[64]:.2f}")
    print(f"ratio_exact_to_bf16_one_stream {ours['exact', 1] / ours['bf16', 1]:.2f}")
    print(f"ratio_exact_to_bf16_64_streams {ours['exact', 64] / ours['bf16', 64]:.2f}")
    print(f"ratio_graphs_to_eager_one_stream_bf16 {ours['bf16', 1] / eager:.2f}")
    print(f"ratio_sampled_to_greedy_64_streams_bf16 {sampled / ours['bf16', 64]:.2f}")


if __name__ == "__main__":
    main()
