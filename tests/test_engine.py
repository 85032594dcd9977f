"""The engine contract: exact logprobs, processed mode, seeds, finish reasons, abort."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from conftest import run
from reference import full_logprobs

from probserve.engine import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    LogprobsMode,
    LogprobsSpec,
    RequestError,
    SamplingParams,
)
from probserve.models import LoadedModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]


def _ids(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer(text).input_ids)


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _greedy(rid: str, ids: tuple[int, ...], n: int = 12, k: int = 5, **kw) -> EngineRequest:
    return EngineRequest(
        rid,
        ids,
        SamplingParams(temperature=0.0, max_tokens=n, **kw),
        LogprobsSpec(top_k=k, prompt_top_k=k),
    )


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_logprobs_equal_full_forward(any_model: LoadedModel, engine_for, prompt: str):
    eng = engine_for(any_model)
    ids = _ids(any_model, prompt)
    outs = run(eng.generate(_greedy("r", ids, ignore_eos=True)))
    gen = _tokens(outs)
    assert len(gen) == 12
    ref = full_logprobs(any_model.model, [*ids, *gen])

    # generated tokens: position p predicts token p+1 (an output may carry several: prompt
    # lookup's accepted proposals, one logprobs row each)
    rows = [(out.logprobs, i) for out in outs for i in range(len(out.new_token_ids))]
    for j, (lp, i) in enumerate(rows):
        pos = len(ids) - 1 + j
        assert lp is not None
        tok = int(lp.token_ids[i])
        assert tok == gen[j] == int(torch.argmax(ref[pos]))  # greedy picks the argmax
        assert abs(float(lp.logprobs[i]) - float(ref[pos, tok])) < 1e-4
        assert int(lp.ranks[i]) == 1
        top = torch.topk(ref[pos], 5)
        np.testing.assert_allclose(lp.top_logprobs[i], top.values.numpy(), atol=1e-4)
        # the ids are the reference's top 5, up to the order of near-equal values (a random
        # model's alternatives can tie within float32 noise: on AVX2 and AVX-512 differently)
        ids_found = lp.top_ids[i].tolist()
        assert len(set(ids_found)) == 5
        np.testing.assert_allclose(ref[pos, ids_found].numpy(), top.values.numpy(), atol=1e-4)

    # prompt logprobs: positions 1..len-1
    plp = outs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(ids) - 1
    targets = torch.tensor(ids[1:])
    expected = ref[: len(ids) - 1].gather(1, targets.view(-1, 1)).view(-1)
    np.testing.assert_allclose(plp.logprobs, expected.numpy(), atol=1e-4)
    # ranks, up to float noise between near-equal logits
    rows = ref[: len(ids) - 1]
    lo = (rows > expected.view(-1, 1) + 1e-4).sum(1) + 1
    hi = (rows > expected.view(-1, 1) - 1e-4).sum(1) + 1
    assert ((lo.numpy() <= plp.ranks) & (plp.ranks <= hi.numpy())).all()
    np.testing.assert_allclose(
        plp.top_logprobs, torch.topk(ref[: len(ids) - 1], 5).values.numpy(), atol=1e-4
    )


def test_sampled_token_logprob_and_rank_exact(smol: LoadedModel, engine_for):
    """Random sampling: each sampled token's raw logprob and rank match the reference."""
    eng = engine_for(smol, speculative="off")  # one token an output: rows by position
    ids = _ids(smol, PROMPTS[2])
    req = EngineRequest(
        "s",
        ids,
        SamplingParams(temperature=1.3, seed=7, max_tokens=10, ignore_eos=True),
        LogprobsSpec(top_k=3),
    )
    outs = run(eng.generate(req))
    gen = _tokens(outs)
    ref = full_logprobs(smol.model, [*ids, *gen])
    for j, out in enumerate(outs):
        pos = len(ids) - 1 + j
        lp = out.logprobs
        assert lp is not None
        assert abs(float(lp.logprobs[0]) - float(ref[pos, gen[j]])) < 1e-4
        v = ref[pos, gen[j]]
        assert int((ref[pos] > v + 1e-4).sum()) + 1 <= int(lp.ranks[0])
        assert int(lp.ranks[0]) <= int((ref[pos] > v - 1e-4).sum()) + 1


def test_processed_top_p_masks_and_renormalises(smol: LoadedModel, engine_for):
    eng = engine_for(smol, speculative="off")  # one token an output: rows by position
    ids = _ids(smol, PROMPTS[0])
    req = EngineRequest(
        "p",
        ids,
        SamplingParams(temperature=1.0, top_p=0.6, seed=3, max_tokens=4, ignore_eos=True),
        LogprobsSpec(top_k=20, mode=LogprobsMode.PROCESSED),
    )
    outs = run(eng.generate(req))
    gen = _tokens(outs)
    ref = full_logprobs(smol.model, [*ids, *gen])
    saw_mask = False
    for j, out in enumerate(outs):
        pos = len(ids) - 1 + j
        lp = out.logprobs
        assert lp is not None
        vals = lp.top_logprobs[0]
        kept = np.isfinite(vals)
        saw_mask |= not kept.all()
        # the nucleus: the smallest prefix of the sorted distribution reaching 0.6
        raw_sorted = torch.sort(ref[pos], descending=True)
        probs = raw_sorted.values.exp()
        n_keep = int(((probs.cumsum(0) - probs) < 0.6).sum())
        assert int(kept.sum()) == min(n_keep, 20)
        kept_ids = raw_sorted.indices[:n_keep]
        renorm = ref[pos, kept_ids] - torch.logsumexp(ref[pos, kept_ids], 0)
        np.testing.assert_allclose(vals[:n_keep][: min(n_keep, 20)], renorm[:20].numpy(), atol=1e-4)
        assert np.isneginf(vals[~kept]).all()
        # the sampled token is inside the nucleus and carries its renormalised logprob
        assert gen[j] in kept_ids.tolist()
        assert np.isfinite(lp.logprobs[0])
    assert saw_mask, "top_p 0.6 should mask some of the top 20 at some position"


def test_seed_reproducible_alone_and_in_company(smol: LoadedModel, engine_for):
    eng = engine_for(smol)
    ids = _ids(smol, PROMPTS[2])

    def req(rid: str, seed: int) -> EngineRequest:
        return EngineRequest(
            rid, ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        )

    first = _tokens(run(eng.generate(req("a", 42))))
    second = _tokens(run(eng.generate(req("b", 42))))
    other = _tokens(run(eng.generate(req("c", 43))))
    assert first == second
    assert first != other

    async def together() -> list[list[int]]:
        results = await asyncio.gather(
            eng.generate(req("x", 42)), eng.generate(req("y", 43)), eng.generate(req("z", 42))
        )
        return [_tokens(r) for r in results]

    x, y, z = run(together())
    assert x == z == first
    assert y == other


def test_finish_reasons(smol: LoadedModel, engine_for):
    eng = engine_for(smol)
    ids = _ids(smol, PROMPTS[0])
    first_greedy = _tokens(run(eng.generate(_greedy("g", ids, n=1))))[0]

    # a stop token id: generation ends on it and it is reported
    outs = run(eng.generate(_greedy("s", ids, n=8, stop_token_ids=(first_greedy,))))
    assert _tokens(outs) == [first_greedy]
    assert outs[-1].finish_reason == FinishReason.STOP

    # min_tokens holds the stop token back
    outs = run(eng.generate(_greedy("m", ids, n=8, stop_token_ids=(first_greedy,), min_tokens=3)))
    assert _tokens(outs)[0] != first_greedy and len(_tokens(outs)) >= 3

    # max_tokens
    outs = run(eng.generate(_greedy("l", ids, n=3, ignore_eos=True)))
    assert len(_tokens(outs)) == 3 and outs[-1].finish_reason == FinishReason.LENGTH

    # max_tokens 0: prompt scored, nothing generated
    outs = run(eng.generate(_greedy("z", ids, n=0)))
    assert _tokens(outs) == [] and outs[-1].finish_reason == FinishReason.LENGTH
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(ids) - 1

    # EOS: the chat turn ends with <|im_end|>
    chat = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    outs = run(eng.generate(_greedy("e", _ids(smol, chat), n=60)))
    assert outs[-1].finish_reason == FinishReason.STOP
    assert _tokens(outs)[-1] in smol.eos_token_ids


def test_abort_frees_everything(smol: LoadedModel, engine_for):
    eng = engine_for(smol, max_num_seqs=1)
    ids = _ids(smol, PROMPTS[1])

    async def scenario() -> None:
        long = EngineRequest("long", ids, SamplingParams(max_tokens=200, ignore_eos=True))
        queued = EngineRequest("queued", ids, SamplingParams(max_tokens=200, ignore_eos=True))
        it = await eng.submit(long)
        it2 = await eng.submit(queued)
        await it.__anext__()  # the long one is running and holds its cache
        eng.abort("long")
        await it2.aclose()  # leaving the iterator early aborts too (a client that went away)
        for _ in range(200):
            s = eng.stats()
            if s.waiting == s.running == s.held_caches == s.streams == 0:
                break
            await asyncio.sleep(0.02)
        keys = ("waiting", "running", "held_caches", "streams")
        counts = {k: getattr(eng.stats(), k) for k in keys}
        assert counts == {"waiting": 0, "running": 0, "held_caches": 0, "streams": 0}
        assert eng.stats().kv_cache_usage == 0.0
        # the engine keeps serving
        outs = await eng.generate(_greedy("after", ids, n=2))
        assert len(_tokens(outs)) == 2

    run(scenario())


def test_concurrent_requests_match_solo(tiny: LoadedModel, engine_for):
    eng = engine_for(tiny, max_num_seqs=3)
    reqs = [_greedy(f"c{i}", _ids(tiny, p), n=6, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    solo = [run(eng.generate(r)) for r in reqs]

    async def together() -> list[list[EngineOutput]]:
        return await asyncio.gather(*(eng.generate(r) for r in reqs))

    for a, b in zip(solo, run(together()), strict=True):
        assert _tokens(a) == _tokens(b)
        np.testing.assert_allclose(
            np.concatenate([o.logprobs.logprobs for o in a]),
            np.concatenate([o.logprobs.logprobs for o in b]),
            atol=1e-4,
        )


def test_request_validation(tiny: LoadedModel, engine_for):
    eng = engine_for(tiny)

    async def submit(req: EngineRequest) -> None:
        await eng.submit(req)

    with pytest.raises(RequestError) as err:
        run(submit(EngineRequest("v", (1, tiny.vocab_size + 5))))
    assert err.value.param == "prompt"
    with pytest.raises(RequestError) as err:
        run(submit(EngineRequest("v", (1, 2), SamplingParams(max_tokens=tiny.context_length))))
    assert "256" in str(err.value) and err.value.param == "max_tokens"
    with pytest.raises(RequestError):
        run(submit(EngineRequest("v", ())))


def test_the_faster_matrix_kernel_is_chosen_and_held_alone(
    smol: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    from probserve.kernels.torch_ops import TorchOps
    from probserve.models import linear as linear_module
    from probserve.models.llama import LlamaForward

    w = smol.model.model.layers[0].mlp.down_proj.weight
    assert linear_module.choose_kernel(w) in ("dense", "onednn")
    times = {"dense": 2.0, "onednn": 1.0}
    with monkeypatch.context() as mp:
        mp.setattr(linear_module, "_time", lambda layer, rows: times[layer.ops.kernel])
        assert linear_module.choose_kernel(w) == "onednn"
        times["dense"] = 0.5
        assert linear_module.choose_kernel(w) == "dense"
    fw = LlamaForward(smol.model, TorchOps("dense"))
    layer = fw.layers[0]
    # a private dense copy: not the (possibly memory-mapped) source, and no packed twin
    assert layer.down.w.data_ptr() != smol.model.model.layers[0].mlp.down_proj.weight.data_ptr()
    assert not layer.down.w.is_mkldnn and torch.equal(layer.down.w, w)
    packed = LlamaForward(smol.model, TorchOps("onednn")).layers[0].down
    assert packed.w.is_mkldnn  # the reordered form alone, no dense twin
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(packed(x), layer.down(x), atol=1e-4, rtol=0)


def test_engine_stats_of_several_engines_add_counts_and_average_fractions():
    from probserve.engine import EngineStats

    a = EngineStats(
        running=2,
        kv_cache_usage=0.5,
        iteration_tokens=(1,) * 13,
        process_resident_memory_bytes=1e8,
        process_cpu_seconds=1.5,
        replicas=None,
    )
    b = EngineStats(
        running=1,
        kv_cache_usage=0.1,
        iteration_tokens=(2,) * 13,
        process_resident_memory_bytes=2e8,
        process_cpu_seconds=0.5,
    )
    both = EngineStats.summed([a, b])
    assert both.running == 3 and abs(both.kv_cache_usage - 0.3) < 1e-12
    assert both.iteration_tokens == (3,) * 13
    assert both.process_resident_memory_bytes == 3e8 and both.process_cpu_seconds == 2.0
    assert both.replicas is None and EngineStats.summed([]) == EngineStats()
    assert "replicas" not in both.figures() and both.figures()["iteration_tokens"] == [3] * 13
