"""probserve's logprobs extensions against an independent full forward: target-token logprobs,
exact entropy, raw and processed side by side, and /v1/score."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from reference import full_logprobs

from probserve.api.prompts import render_chat
from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TARGETS = [504, 30, 2, 1000]  # arbitrary ids, special and ordinary


def _entropy(row: torch.Tensor) -> float:
    return float(torch.special.entr(row.exp()).sum())


def _greedy(smol: LoadedModel, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The reference's own greedy continuation (no retokenizing of text): ids and the logprob
    rows of every position."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(full_logprobs(smol.model, ids)[-1].argmax()))
    return ids, full_logprobs(smol.model, ids)


def test_completions_targets_and_entropy_equal_the_reference(http, smol: LoadedModel):
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "logprob_token_ids": TARGETS,
        "return_entropy": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    prompt_ids = smol.tokenizer(body["prompt"]).input_ids
    ids, ref = _greedy(smol, prompt_ids, 4)
    assert len(lp["target_logprobs"]) == len(lp["entropy"]) == len(lp["tokens"]) == len(ids)
    assert lp["target_logprobs"][0] is None and lp["entropy"][0] is None
    for pos in range(1, len(ids)):  # prompt positions and generated ones alike
        row = ref[pos - 1]
        got = lp["target_logprobs"][pos]
        assert list(got) == [str(t) for t in TARGETS]
        for t in TARGETS:
            assert abs(got[str(t)] - float(row[t])) < 1e-4, (pos, t)
        assert abs(lp["entropy"][pos] - _entropy(row)) < 1e-4
    assert n_prompt == len(prompt_ids)
    # streamed: the same figures, chunk by chunk
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = [e for c in chunks for e in c["choices"][0]["logprobs"]["entropy"]]
    assert len(streamed) == len(lp["entropy"])
    for a, b in zip(streamed, lp["entropy"], strict=True):
        assert (a is None and b is None) or abs(a - b) < 1e-4


def test_chat_and_responses_targets_and_entropy(http, smol: LoadedModel):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
              "logprobs": True, "top_logprobs": 1, "logprob_token_ids": TARGETS,
              "return_entropy": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    prompt = render_chat(smol, msgs, True, {})
    _, ref = _greedy(smol, prompt, 4)
    for j, e in enumerate(entries):
        row = ref[len(prompt) + j - 1]
        assert [t["id"] for t in e["target_logprobs"]] == TARGETS
        assert all(abs(t["logprob"] - float(row[t["id"]])) < 1e-4 for t in e["target_logprobs"])
        assert abs(e["entropy"] - _entropy(row)) < 1e-4
    resp = http.post(
        "/v1/responses",
        json={"model": MODEL, "input": "Name a colour.", "max_output_tokens": 4,
              "temperature": 0, "top_logprobs": 1, "logprob_token_ids": TARGETS,
              "return_entropy": True},
    ).json()  # fmt: skip
    same = resp["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in same] == [e["token"] for e in entries]
    for a, b in zip(same, entries, strict=True):
        assert abs(a["entropy"] - b["entropy"]) < 1e-4
        assert a["target_logprobs"][0]["id"] == TARGETS[0]


def test_raw_and_processed_side_by_side(http, smol: LoadedModel):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0.7,
        "top_k": 10,
        "seed": 11,
        "logprobs": 3,
        "logprobs_mode": "both",
    }
    r = http.post("/v1/completions", json=body).json()
    lp = r["choices"][0]["logprobs"]
    prompt_ids = smol.tokenizer(body["prompt"]).input_ids
    gen_ids = smol.tokenizer(r["choices"][0]["text"], add_special_tokens=False).input_ids
    ids = prompt_ids + gen_ids
    with torch.inference_mode():
        logits = smol.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    for j in range(len(gen_ids)):
        row = logits[len(prompt_ids) + j - 1]
        raw = torch.log_softmax(row, -1)
        scaled = (row - row.max()) / 0.7
        kth = torch.topk(scaled, 10).values[-1]
        proc = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
        tid = gen_ids[j]
        assert abs(lp["token_logprobs"][j] - float(raw[tid])) < 1e-4
        assert abs(lp["processed"]["token_logprobs"][j] - float(proc[tid])) < 1e-4
        best = max(lp["processed"]["top_logprobs"][j].values())
        assert abs(best - float(proc.max())) < 1e-4
    # chat: processed beside raw on every entry
    c = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
              "temperature": 0.7, "top_k": 10, "seed": 3, "logprobs": True, "top_logprobs": 2,
              "logprobs_mode": "both"},
    ).json()  # fmt: skip
    for e in c["choices"][0]["logprobs"]["content"]:
        # a cooler, top-k-cut distribution puts more mass on its best token
        best_raw, best_proc = e["top_logprobs"][0], e["processed_top_logprobs"][0]
        assert best_proc["token"] == best_raw["token"]
        assert best_proc["logprob"] >= best_raw["logprob"] - 1e-6
        assert len(e["processed_top_logprobs"]) == 2 and "processed_logprob" in e


def test_extension_errors(http):
    base = {"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 1}
    for extra, param in (
        ({"logprob_token_ids": [10**9]}, "logprob_token_ids"),
        ({"logprob_token_ids": [-1]}, "logprob_token_ids"),
        ({"logprob_token_ids": [1] * 257}, "logprob_token_ids"),
        ({"logprobs": None, "return_entropy": True}, "return_entropy"),
        ({"logprobs": None, "logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"logprobs_mode": "sideways"}, "logprobs_mode"),
    ):
        r = http.post("/v1/completions", json={**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    plain = http.post("/v1/completions", json=base).json()["choices"][0]["logprobs"]
    assert set(plain) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


def test_score_endpoint_equals_completions(http, smol: LoadedModel):
    labels = [smol.tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" Yes", " No")]
    body = {
        "model": MODEL,
        "query": "Is Paris the capital of France? Answer:",
        "items": ["", " Think:"],
        "label_token_ids": labels,
        "apply_softmax": False,
    }
    r = http.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and len(out["scores"]) == 2
    for item, scores in zip(body["items"], out["scores"], strict=True):
        ids = smol.tokenizer(body["query"] + item).input_ids
        row = full_logprobs(smol.model, ids)[-1]
        for label, score in zip(labels, scores, strict=True):
            assert abs(math.log(score) - float(row[label])) < 1e-4
    soft = http.post("/v1/score", json={**body, "apply_softmax": True}).json()["scores"]
    for raw, norm in zip(out["scores"], soft, strict=True):
        assert abs(sum(norm) - 1.0) < 1e-6
        assert abs(norm[0] - raw[0] / sum(raw)) < 1e-5
    # the same figures from a completions request
    comp = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": body["query"], "max_tokens": 1, "temperature": 0,
              "logprobs": 0, "logprob_token_ids": labels},
    ).json()["choices"][0]["logprobs"]["target_logprobs"][0]  # fmt: skip
    assert abs(comp[str(labels[0])] - math.log(out["scores"][0][0])) < 1e-4
    item_first = http.post("/v1/score", json={**body, "item_first": True}).json()["scores"]
    assert item_first[0] == pytest.approx(out["scores"][0], abs=1e-6)  # "" + query == query
    for bad, param in (
        ({"label_token_ids": [10**9]}, "label_token_ids"),
        ({"label_token_ids": []}, "label_token_ids"),
        ({"items": []}, "items"),
    ):
        resp = http.post("/v1/score", json={**body, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_chat_prompt_scoring_knows_the_template(http, smol: LoadedModel):
    from probserve.api.answers.tokens import TokenTable

    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 2, "logprobs": True, "return_entropy": True,
            "logprob_token_ids": TARGETS}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    ids = render_chat(smol, msgs, True, {})
    sources, plp = r["prompt_token_sources"], r["prompt_logprobs"]
    assert len(sources) == len(plp) == len(ids)
    table = TokenTable(smol.tokenizer, smol.vocab_size)
    texts = [table.decode([t]) for t in ids]
    rendered = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "".join(texts) == rendered  # the attributed tokens rebuild the rendered template
    for i, m in enumerate(msgs):
        mine = "".join(t for t, s in zip(texts, sources, strict=True) if s["message_index"] == i)
        assert mine.strip() == m["content"] and all(
            s["role"] == m["role"] for s in sources if s["message_index"] == i
        )
    template = "".join(t for t, s in zip(texts, sources, strict=True) if s["role"] == "template")
    assert "<|im_start|>" in template and "France" not in template
    # the values: the reference's, at every position
    ref = full_logprobs(smol.model, ids)
    for j in range(1, len(ids)):
        got = plp[j][str(ids[j])]["logprob"]
        assert abs(got - float(ref[j - 1][ids[j]])) < 1e-4
        assert abs(r["prompt_entropy"][j] - _entropy(ref[j - 1])) < 1e-4
        targets = r["prompt_target_logprobs"][j]
        assert [t["id"] for t in targets] == TARGETS
        assert all(abs(t["logprob"] - float(ref[j - 1][t["id"]])) < 1e-4 for t in targets)
    assert r["prompt_entropy"][0] is None and r["prompt_target_logprobs"][0] is None
    # streamed (first chunk) and again from the prefix cache: the same
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    first = next(c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0])
    streamed = first["choices"][0]
    assert streamed["prompt_token_sources"] == sources
    assert len(streamed["prompt_entropy"]) == len(ids)
    for a, b in zip(streamed["prompt_logprobs"][1:], plp[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-4 for t in a)


def test_chat_echo_scores_the_final_answer(http, smol: LoadedModel):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    answer = "The capital of France is Paris."
    body = {"model": MODEL, "messages": [*q, {"role": "assistant", "content": answer}],
            "echo": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    cont = r.json()["choices"][0]["continuation"]
    prefix = render_chat(smol, q, True, {})
    ans = smol.tokenizer(answer, add_special_tokens=False).input_ids
    ref = full_logprobs(smol.model, prefix + ans)
    rows = [ref[len(prefix) + j - 1] for j in range(len(ans))]
    assert b"".join(bytes(e["bytes"]) for e in cont["content"]).decode() == answer
    want = sum(float(row[t]) for row, t in zip(rows, ans, strict=True))
    assert abs(cont["logprob_sum"] - want) < 1e-3
    greedy = all(int(row.argmax()) == t for row, t in zip(rows, ans, strict=True))
    assert cont["is_greedy"] == greedy
    assert all(len(e["top_logprobs"]) == 2 for e in cont["content"])
    assert r.json()["usage"]["completion_tokens"] == 0
    for bad, param in (
        ({"messages": q}, "messages"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"stream": True}, "stream"),
    ):
        resp = http.post("/v1/chat/completions", json={**body, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_full_distributions_equal_the_reference(http, smol: LoadedModel):
    import base64

    import numpy as np

    prompt = "The capital of France is Paris, and the capital of Spain is"
    ids = smol.tokenizer(prompt).input_ids
    ref = full_logprobs(smol.model, ids)
    r = http.post("/v1/distributions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["positions"] == list(range(len(ids))) and out["token_ids"] == ids
    assert out["shape"] == [len(ids), smol.vocab_size] and out["dtype"] == "float32"
    rows = np.frombuffer(base64.b64decode(out["data"]), np.float32).reshape(out["shape"])
    assert float(np.abs(rows - ref.numpy()).max()) < 1e-4  # every position, the last included
    # a few positions, float16, raw bytes
    pick = [0, 5, len(ids) - 1]
    b = http.post(
        "/v1/distributions",
        json={"prompt": ids, "positions": pick, "dtype": "float16"},
        headers={"accept": "application/octet-stream"},
    )
    assert b.headers["content-type"] == "application/octet-stream"
    assert b.headers["x-shape"] == f"3,{smol.vocab_size}" and b.headers["x-dtype"] == "float16"
    half = np.frombuffer(b.content, np.float16).reshape(3, -1).astype(np.float32)
    finite = np.isfinite(half)
    want = ref.numpy()[pick]
    assert np.allclose(half[finite], want[finite], atol=2e-2, rtol=1e-3)
    for bad, param in (
        ({"positions": [len(ids)]}, "positions"),
        ({"positions": [3, 1]}, "positions"),
        ({"positions": list(range(600))}, "positions"),
        ({"prompt": [10**9]}, "prompt"),
    ):
        resp = http.post("/v1/distributions", json={"prompt": prompt, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_distribution_rows_in_flight_are_bounded(smol: LoadedModel):
    from server_util import running_state

    with running_state(smol, "--max-distribution-rows-in-flight", "8") as (url, state):
        import httpx

        state.distribution_rows.take(6)  # as if another request held 6 rows
        r = httpx.post(f"{url}/v1/distributions", json={"prompt": "one two three four"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        state.distribution_rows.give_back(6)
        ok = httpx.post(f"{url}/v1/distributions", json={"prompt": "one two three four"})
        assert ok.status_code == 200
        for _ in range(100):  # given back once the answer has been sent
            if state.distribution_rows.used == 0:
                break
            time.sleep(0.05)
        assert state.distribution_rows.used == 0


def test_rerank_scores_are_the_scoring_paths(http, smol: LoadedModel):
    """/v1/rerank: each document's relevance_score equals /v1/score's probability of " yes"
    (renormalised over " yes" and " no") after the relevance prompt, and is within 1e-4 of
    transformers' float32 forward of that prompt; most relevant first, the first top_n,
    documents as strings or {"text"}; the aliases answer the same; an empty or oversized
    document list is a 400 naming it."""
    docs = [
        "Paris is the capital and largest city of France.",
        "Bananas are a good source of potassium.",
        {"text": "The Eiffel Tower is in Paris."},
    ]
    body = {"query": "What is the capital of France?", "documents": docs}
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    texts = [d if isinstance(d, str) else d["text"] for d in docs]
    ids = [smol.tokenizer(a, add_special_tokens=False).input_ids[0] for a in (" yes", " no")]
    score = http.post(
        "/v1/score",
        json={
            "query": f"Query: {body['query']}\nDocument: ",
            "items": [t + "\nIs the document relevant to the query? Answer:" for t in texts],
            "label_token_ids": ids, "apply_softmax": True,
        },
    ).json()["scores"]  # fmt: skip
    want = sorted(range(3), key=lambda i: (-score[i][0], i))
    assert [res["index"] for res in answer["results"]] == want
    # the independent reference: the model's own forward of the whole prompt, the labels read
    # at its last position (each label one token) and renormalised over the two
    assert all(len(smol.tokenizer(a, add_special_tokens=False).input_ids) == 1
               for a in (" yes", " no"))  # fmt: skip
    prompts = [
        smol.tokenizer(
            f"Query: {body['query']}\nDocument: {t}\nIs the document relevant to the query? Answer:"
        ).input_ids
        for t in texts
    ]
    assert answer["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
    reference = [
        torch.softmax(full_logprobs(smol.model, p)[-1].double()[ids], 0)[0].item() for p in prompts
    ]
    for res in answer["results"]:
        assert abs(res["relevance_score"] - reference[res["index"]]) < 1e-4, (res, reference)
    assert max(reference) - min(reference) > 1e-3, reference  # they differ: a check that can fail
    for res in answer["results"]:
        assert res["relevance_score"] == score[res["index"]][0]
        assert res["document"] == {"text": texts[res["index"]]}
    assert answer["usage"]["total_tokens"] > 0 and answer["object"] == "rerank"
    top = http.post("/rerank", json={**body, "top_n": 1, "return_documents": False}).json()
    assert [(x["index"], x["relevance_score"]) for x in top["results"]] == [
        (want[0], score[want[0]][0])
    ]
    assert top["results"][0].get("document") is None
    assert http.post("/v2/rerank", json=body).json()["results"] == answer["results"]
    for bad in ({**body, "documents": []}, {**body, "documents": ["x"] * 100_000}):
        err = http.post("/v1/rerank", json=bad)
        assert err.status_code == 400 and err.json()["error"]["param"] == "documents", err.text


def test_embeddings_are_the_models_final_hidden_states(http, smol: LoadedModel):
    """/v1/embeddings: each input's final-norm hidden states pooled (last token by default,
    mean, cls) and L2-normalised, within 1e-4 of transformers' float32 hidden states of the
    same weights; texts, token ids, base64 (the same floats); dimensions other than the
    model's refused naming the field."""
    import base64

    import numpy as np

    texts = ["The capital of France is Paris.", "Bananas are yellow"]
    r = http.post("/v1/embeddings", json={"input": texts})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]

    def reference(text: str, how: str) -> np.ndarray:
        ids = smol.tokenizer(text).input_ids
        with torch.no_grad():
            out = smol.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        h = out.hidden_states[-1][0].double()
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[how].numpy()
        return v / np.linalg.norm(v)

    for d, text in zip(answer["data"], texts, strict=True):
        got = np.asarray(d["embedding"])
        assert got.shape == (smol.model.config.hidden_size,)
        assert np.abs(got - reference(text, "last")).max() < 1e-4
    for how in ("mean", "cls"):
        d = http.post("/v1/embeddings", json={"input": texts[0], "pooling": how}).json()["data"]
        assert np.abs(np.asarray(d[0]["embedding"]) - reference(texts[0], how)).max() < 1e-4
    ids = smol.tokenizer(texts[0]).input_ids
    by_ids = http.post("/v1/embeddings", json={"input": ids}).json()["data"][0]["embedding"]
    assert by_ids == answer["data"][0]["embedding"]
    b64 = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    floats = np.frombuffer(base64.b64decode(b64["data"][1]["embedding"]), "<f4")
    assert floats.tolist() == answer["data"][1]["embedding"]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    bad = http.post("/v1/embeddings", json={"input": "x", "dimensions": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    same = http.post("/v1/embeddings", json={"input": "x", "dimensions": 576})
    assert same.status_code == 200
    big = http.post("/v1/embeddings", json={"input": ["x" * 600_000, "y" * 600_000]})
    assert big.status_code == 400 and big.json()["error"]["param"] == "input", big.text
