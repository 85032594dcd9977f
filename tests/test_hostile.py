"""Hostile clients: one request must never stop, freeze or starve the server.

Each test sends a request found by a hostile-client audit, checks the answer (a 4xx envelope
with the right `param`, or a correct output), and then that a canary request answers exactly as
before and `/health` is ok and idle. Where the defect froze the event loop, `/health` is polled
while the hostile request is processed and must answer within a generous bound.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import run
from hostile_util import error_of, post_raw, watched
from server_util import running_server, running_state, wait_until

from probserve.api.answers.text_stream import TextStream
from probserve.api.answers.tokens import TokenTable
from probserve.api.pipeline.candidates import Candidate, run_all
from probserve.engine import EngineRequest, FinishReason, SamplingParams
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.logprobs import SCORE_CHUNK_ROWS
from probserve.engine.core.scheduler import Scheduler
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.step import Chunk
from probserve.engine.prefix_hash import block_hash
from probserve.models import LoadedModel
from probserve.models.llama import LlamaForward

pytestmark = pytest.mark.slow

# far below the seconds to minutes the defects cost, and far above a loaded 2-core machine's
# scheduling noise (the server shares this process, and its GIL, with the test)
HEALTH_BOUND_S = 2.0


@pytest.fixture(scope="module")
def url(smol: LoadedModel) -> Iterator[str]:
    with running_server(
        smol, "--kv-cache-gib", "0.5", "--header-timeout", "1", "--body-timeout", "1"
    ) as u:
        yield u


@pytest.fixture(scope="module")
def c(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client


# ---- 1. seeds -----------------------------------------------------------------------------------


def test_huge_seed_is_a_400_and_the_engine_lives(c: httpx.Client, after_check: None):
    for seed in (2**64, 18446744073709551616, -(2**63) - 1, 10**400):
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "seed": seed})
        error_of(r, 400, "seed")
    # the edges of int64 are fine, with n candidates past them too (seeds wrap modulo 2**64)
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "Hi", "max_tokens": 2, "seed": seed, "n": 2}
        assert c.post("/v1/completions", json=body).status_code == 200


def test_engine_seeds_any_integer(tiny: LoadedModel, engine_for):
    eng = engine_for(tiny)

    def req(rid: str, seed: int) -> EngineRequest:
        return EngineRequest(rid, (1, 2, 3), SamplingParams(max_tokens=3, seed=seed))

    async def scenario() -> list:
        return await asyncio.gather(
            eng.generate(req("a", 2**70 + 5)), eng.generate(req("b", 5)), eng.generate(req("c", -1))
        )

    a, b, neg = run(scenario())
    assert a[-1].finish_reason == b[-1].finish_reason == neg[-1].finish_reason
    # equal modulo 2**64 (joined: a request alone may take proposals where others do not)
    assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids]


def test_engine_loop_survives_any_exception_from_one_request(tiny: LoadedModel, engine_for):
    eng = engine_for(tiny)
    real_add = eng.core.add_request

    def add(req: EngineRequest) -> None:
        if req.request_id == "poison":
            raise OverflowError("something no one expected")
        real_add(req)

    eng.core.add_request = add  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def scenario() -> list:
        return await asyncio.gather(
            eng.generate(EngineRequest("poison", (1, 2), params)),
            eng.generate(EngineRequest("good", (1, 2), params)),
        )

    poison, good = run(scenario())
    assert poison[-1].finish_reason == FinishReason.ERROR and "OverflowError" in poison[-1].error
    assert good[-1].finish_reason == FinishReason.LENGTH
    later = run(eng.generate(EngineRequest("later", (3, 4), params)))
    assert later[-1].finish_reason == FinishReason.LENGTH
    assert eng.health() == ("ok", None) and eng.stats().held_caches == 0


# ---- 2. long token-id prompts -------------------------------------------------------------------


def test_long_id_prompts_are_refused_without_freezing(url: str, c: httpx.Client, after_check: None):
    raw = b'{"max_tokens": 1, "prompt": [' + b",".join([b"504"] * 690_000) + b"]}"  # 3.5 MB

    def hostile() -> list[httpx.Response]:
        return [
            c.post("/v1/completions", json={"prompt": [504] * 24_000, "max_tokens": 1}),
            c.post("/v1/completions", json={"prompt": [504] * 80_000, "max_tokens": 1}),
            post_raw(c, "/v1/completions", raw),
            c.post("/v1/completions", json={"prompt": [[504] * 9_000] * 4, "max_tokens": 1}),
        ]

    responses, worst, _ = watched(url, hostile)
    for r in responses:  # type: ignore[attr-defined]
        err = error_of(r, 400, "prompt")
        assert "maximum context length" in err["message"]
    assert worst < HEALTH_BOUND_S, f"/health took {worst:.2f} s during the hostile requests"


def test_text_stream_is_linear(smol: LoadedModel):
    """Decoding a long prompt: 200k tokens, incomplete characters included, in one pass; the
    text and offsets are those of the short-prompt algorithm."""
    table = TokenTable(smol.tokenizer, smol.vocab_size)
    partial = next(i for i in range(table.vocab_size) if table.token_bytes(i) == b"\xe2")
    ids = [504, partial, 504, 30, 504] * 40_000
    ts = TextStream(table)
    ts.add_all(ids)
    pieces = ts.release(final=True)
    assert len(pieces) == len(ids)
    assert ts.text == table.decode(ids)
    assert "".join(p.text for p in pieces) == ts.text
    assert pieces[-1].offset + len(pieces[-1].text) == len(ts.text)


# ---- 3. templates -------------------------------------------------------------------------------


def test_a_client_cannot_run_its_own_template(c: httpx.Client, after_check: None):
    msgs = [{"role": "user", "content": "Hi"}]
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    for key, value in (
        ("chat_template", loop),
        ("chat_template", '{{ "x" * 20000000000 }}'),
        ("tokenize", True),
        ("tools", [{"type": "function"}]),
        ("messages", []),
    ):
        body = {"messages": msgs, "max_tokens": 2, "chat_template_kwargs": {key: value}}
        error_of(c.post("/v1/chat/completions", json=body), 400, f"chat_template_kwargs.{key}")
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": msgs, "chat_template_kwargs": {"chat_template": loop}}
        r = c.post(path, json=body)
        assert r.status_code in (200, 400), r.text  # /tokenize takes no template kwargs at all
    # template variables of the model's own template are fine, and template syntax in a
    # message is text
    ok = {"messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert c.post("/v1/chat/completions", json=ok).status_code == 200
    text = [{"role": "user", "content": loop + '{{ "x" * 20000000000 }}'}]
    assert c.post("/v1/chat/completions", json={"messages": text, "max_tokens": 2}).is_success


# ---- 4. scoring a cached prompt -----------------------------------------------------------------


@pytest.fixture
def inline_client(smol: LoadedModel) -> Iterator[httpx.Client]:
    """A server whose engine runs in this process (inline), so a test can instrument it."""
    args = ("--worker", "inline", "--kv-cache-gib", "0.5")
    with running_server(smol, *args) as u, httpx.Client(base_url=u, timeout=300) as client:
        yield client


def test_scoring_a_cached_prompt_is_bounded_and_done_once(
    inline_client: httpx.Client, monkeypatch: pytest.MonkeyPatch
):
    c = inline_client
    rows_per_call: list[int] = []
    real_logits = LlamaForward.logits

    def counting(self: LlamaForward, hidden):  # type: ignore[no-untyped-def]
        rows_per_call.append(int(hidden.shape[0]))
        return real_logits(self, hidden)

    monkeypatch.setattr(LlamaForward, "logits", counting)
    prompt = " ".join(f"w{i}" for i in range(600))
    first = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    n_prompt = first.json()["usage"]["prompt_tokens"]
    assert n_prompt > 2 * SCORE_CHUNK_ROWS
    rows_per_call.clear()
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "n": 4}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert len(choices) == 4
    lps = [ch["logprobs"]["token_logprobs"][:n_prompt] for ch in choices]
    assert all(lp == lps[0] for lp in lps) and lps[0][0] is None and None not in lps[0][1:]
    # logits never for more than one slice of rows at once, and the prompt scored once (not 4x)
    assert max(rows_per_call) <= SCORE_CHUNK_ROWS
    assert sum(rows_per_call) < 2 * n_prompt, rows_per_call


# ---- 5. lone surrogates -------------------------------------------------------------------------


def test_lone_surrogates_are_a_400(c: httpx.Client, after_check: None):
    s = b'"Hi \\ud800"'
    cases = [
        ("/v1/completions", b'{"prompt": ' + s + b"}", "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", ' + s + b"]}", "prompt[1]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + s + b"}]}", None),
        ("/tokenize", b'{"prompt": ' + s + b"}", "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": ' + s + b"}]}", None),
        ("/v1/completions", b'{"prompt": "x", "model": ' + s + b"}", "model"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "model": "\\udc00"}',
            "model",
        ),
        ("/v1/completions", b'{"prompt": "x", "stop": ["a", ' + s + b"]}", None),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"chat_template_kwargs": {"v": ' + s + b"}}",
            "chat_template_kwargs",
        ),
    ]
    for path, raw, param in cases:
        err = error_of(post_raw(c, path, raw), 400, param)
        assert "surrogate" in err["message"] or "logit_bias" in err["message"], err


# ---- 6. tiny temperatures -----------------------------------------------------------------------


def test_a_tiny_temperature_samples_the_most_likely_token(c: httpx.Client, after_check: None):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 1}
    greedy = c.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]
    for t in (5e-324, 1e-46, 1e-40, 1e-30, 1e-8):  # 5e-324 and 1e-46 are 0 in float32
        got = c.post(
            "/v1/completions", json={**body, "temperature": t, "logprobs_mode": "processed"}
        ).json()["choices"][0]
        assert got["text"] == greedy["text"] and got["text"].startswith(" Paris."), (t, got)
        assert all(v == 0.0 for v in got["logprobs"]["token_logprobs"])  # one-hot, no NaN
    # with a penalty that float32 also rounds to 0 (found by schemathesis: it was a 500)
    extreme = {**body, "temperature": 5e-324, "repetition_penalty": 5e-324, "seed": 1}
    r = c.post("/v1/completions", json=extreme)
    assert r.status_code == 200, r.text


# ---- 7. a failing candidate cancels its siblings ------------------------------------------------


class _Stream:
    def __init__(self, fail: bool, cancelled: list[str], name: str) -> None:
        self.fail, self.cancelled, self.name = fail, cancelled, name

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> object:
        if self.fail:
            from probserve.engine import EngineOutput

            return EngineOutput(self.name, finish_reason=FinishReason.ERROR, error="boom")
        try:
            await asyncio.sleep(3600)  # an engine stream that never speaks again
        except asyncio.CancelledError:
            self.cancelled.append(self.name)
            raise
        raise StopAsyncIteration

    def close(self) -> None:
        pass


def test_a_failing_candidate_cancels_its_siblings(smol: LoadedModel):
    from probserve.api.errors import APIError

    table = TokenTable(smol.tokenizer, smol.vocab_size)
    cancelled: list[str] = []

    class _Request:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(3600)  # a client that stays
            return {"type": "http.disconnect"}

    async def scenario() -> None:
        cands = [
            Candidate(
                EngineRequest(n, (1,)),
                _Stream(n == "bad", cancelled, n),  # type: ignore[arg-type]
                TextStream(table),
            )
            for n in ("a", "bad", "b")
        ]
        with pytest.raises(APIError):
            await asyncio.wait_for(run_all(_Request(), cands, 0), 30)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not pending, pending

    run(scenario())
    assert sorted(cancelled) == ["a", "b"]


# ---- fair share of the batch --------------------------------------------------------------------


def test_one_request_cannot_hold_every_slot(smol: LoadedModel):
    with (
        running_server(smol, "--max-num-seqs", "4", "--kv-cache-gib", "0.25") as url,
        httpx.Client(base_url=url, timeout=300) as c,
    ):
        hog_body = {"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "n": 4}
        hog_done, leave = threading.Event(), threading.Event()

        def hog() -> None:
            with c.stream("POST", "/v1/completions", json={**hog_body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        hog_done.set()
                    if leave.is_set():  # hang up: the hog is aborted
                        return

        thread = threading.Thread(target=hog)
        thread.start()
        try:  # the hog holds every slot (8000 tokens to go: minutes)
            assert wait_until(lambda: c.get("/health").json()["running"] >= 4, 60)
            quick = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert quick.status_code == 200
            assert not hog_done.is_set(), "the one-token request waited for the whole hog"
        finally:
            leave.set()
            thread.join(60)
        assert wait_until(lambda: c.get("/health").json()["running"] == 0, 60)


def test_scheduler_shares_the_batch_between_groups(tiny: LoadedModel):
    pool = BlockPool(200, 4, prefix_caching=True)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)

    def seq(rid: str, group: str) -> Sequence:
        req = EngineRequest(rid, (1, 2, 3), SamplingParams(max_tokens=50), group=group)
        return Sequence(req, 60, frozenset())

    for i in range(8):
        sched.add(seq(f"a{i}", "A"))

    def step() -> None:
        chunks = sched.schedule()
        sched.computed(chunks)
        for ch in chunks:
            if ch.samples:
                sched.append_token(ch.seq, 7)

    step()
    assert [s.group for s in sched.running] == ["A"] * 8  # alone, A takes the whole batch
    for i in range(8):
        sched.add(seq(f"b{i}", "B"))
    for _ in range(10):
        step()
    groups = [s.group for s in sched.running]
    assert groups.count("A") == groups.count("B") == 4, groups


# ---- connections, logs, scopes, caps, hashes ----------------------------------------------------


def test_slow_clients_are_cut_off(url: str, after_check: None):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:  # headers never finished
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(30)
        assert s.recv(1024) == b""  # closed by the server
    with socket.create_connection(("127.0.0.1", port)) as s:  # less than its Content-Length
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        s.settimeout(30)
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert b'"code": "body_timeout"' in head + s.recv(4096)


def test_connections_are_bounded(smol: LoadedModel):
    with running_server(smol, "--max-connections", "3") as url:
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            time.sleep(0.2)
            r = httpx.get(f"{url}/health", timeout=10)
            assert r.status_code == 503
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_access_log_escapes_control_characters_and_logs_500s(
    smol: LoadedModel, caplog: pytest.LogCaptureFixture
):
    import dataclasses

    class Broken:
        def __getattr__(self, name: str) -> object:
            return getattr(smol.tokenizer, name)

        def __call__(self, *a: object, **kw: object) -> object:
            raise RuntimeError("tokenizer crashed")

    broken = dataclasses.replace(smol, tokenizer=Broken())
    with running_server(broken) as url, caplog.at_level(logging.INFO, "probserve.access"):
        r = httpx.get(f"{url}/v1/models/%0A2026-01-01 INFO forged", timeout=30)
        assert r.status_code == 404
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30)
        error_of(r, 500)
        time.sleep(0.2)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "probserve.access"]
    forged = [ln for ln in lines if "forged" in ln]
    assert forged and all("\n" not in ln and "\\n" in ln for ln in forged), lines
    assert any(ln.startswith("POST /v1/completions 500") for ln in lines), lines


def test_websockets_are_refused_without_a_key(smol: LoadedModel):
    from server_util import serve_settings
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from probserve.api.app import create_app
    from probserve.serving import build_state

    state, _ = build_state(serve_settings("--worker", "inline"), smol)
    try:
        app = create_app(state)  # no lifespan: the app's own start and stop never run
        with pytest.raises(WebSocketDisconnect), TestClient(app).websocket_connect("/") as ws:
            ws.receive_text()
    finally:
        state.default.engine.stop()


def test_stop_token_ids_are_capped(c: httpx.Client, after_check: None):
    body = {"prompt": "x", "max_tokens": 1, "stop_token_ids": [2] * 1025}
    error_of(c.post("/v1/completions", json=body), 400, "stop_token_ids")
    msgs = [{"role": "user", "content": "x"}]
    body = {"messages": msgs, "max_tokens": 1, "stop_token_ids": [2] * 1025}
    error_of(c.post("/v1/chat/completions", json=body), 400, "stop_token_ids")


def test_prefix_cache_hash_is_collision_resistant():
    h1 = block_hash(None, [1, 2, 3])
    assert isinstance(h1, bytes) and len(h1) == 32  # SHA-256
    assert block_hash(h1, [4]) != block_hash(None, [4]) != block_hash(block_hash(None, [9]), [4])
    assert block_hash(None, [1, 2, 3]) == h1
    # an id that would alias after truncation to 32 bits stays distinct
    assert block_hash(None, [2**32 + 1]) != block_hash(None, [1])


# ---- liveness -----------------------------------------------------------------------------------


def test_health_tells_the_truth_about_the_engine(tiny: LoadedModel, monkeypatch):
    with running_state(tiny, "--engine-stall-timeout", "0.5") as (url, state):
        eng = state.default.engine
        real_step = eng.core.step
        entered, release = threading.Event(), threading.Event()

        def held_step():  # type: ignore[no-untyped-def]
            entered.set()
            assert release.wait(60)
            return real_step()

        monkeypatch.setattr(eng.core, "step", held_step)
        done: list[int] = []
        body = {"prompt": "Hi", "max_tokens": 1}
        t = threading.Thread(
            target=lambda: done.append(
                httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
            )
        )
        t.start()
        try:
            assert entered.wait(30)  # a step is running, and will not end until released

            def stuck() -> bool:
                h = httpx.get(f"{url}/health", timeout=10)
                return h.status_code == 503 and h.json()["status"] == "stuck"

            assert wait_until(stuck, 30)  # past the 0.5 s stall bound, on one and the same answer
        finally:
            release.set()
        t.join(60)
        assert done == [200]
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 30)

        fatal: list[str] = []
        eng.on_fatal = fatal.append

        def dying_step():  # type: ignore[no-untyped-def]
            raise SystemExit("the engine thread is gone")

        monkeypatch.setattr(eng.core, "step", dying_step)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        error_of(r, 500)  # the request in flight ends with an error, not a hang
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and h.json()["status"] == "dead", h.text
        assert wait_until(lambda: fatal, 10) and "SystemExit" in fatal[0]
        err = error_of(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 503)
        assert err["code"] == "engine_dead"


def _prompt_flood(sched: Scheduler, count: int, length: int) -> None:
    """`count` embedding requests (prompt-only: max_tokens 0, pooled) of `length` tokens, each
    a request (a group) of its own, as a client flooding /v1/embeddings sends them."""
    for i in range(count):
        ids = tuple(range(1, length + 1))
        req = EngineRequest(f"e{i}", ids, SamplingParams(max_tokens=0), group=f"E{i}", embed="last")
        sched.add(Sequence(req, length, frozenset()))


def _step(sched: Scheduler) -> list[Chunk]:
    """One step: the chunks scheduled (prompt-only sequences end when computed, as the engine's
    update ends them; a generating one samples token 7)."""
    chunks = sched.schedule()
    sched.computed(chunks)
    for ch in chunks:
        if ch.seq.score_only and ch.seq.num_computed >= ch.seq.num_tokens:
            sched.finish(ch.seq)
        elif ch.samples:
            sched.append_token(ch.seq, 7)
    return chunks


def test_a_prompt_flood_does_not_starve_generation():
    """~1,000 embedding inputs in flight (#60: they delayed a one-token completion 3.5-5.8 s):
    a generating request that arrives behind them is scheduled in the next step, and its prompt
    gets at least half of every step's budget while the flood lasts (the flood the rest)."""
    pool = BlockPool(4000, 16, prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=512)
    _prompt_flood(sched, 1000, 24)
    for _ in range(3):
        _step(sched)
    prompt = tuple(range(2, 1002))  # a 1,000-token prompt: two steps' whole budgets
    sched.add(Sequence(EngineRequest("gen", prompt, SamplingParams(max_tokens=4)), 1010,
                       frozenset()))  # fmt: skip
    taken = []
    for _ in range(5):
        chunks = _step(sched)
        taken.append(sum(ch.length for ch in chunks if ch.seq.request_id == "gen"))
        flood = sum(ch.length for ch in chunks if ch.seq.score_only)
        assert flood > 0, "the flood itself is not starved"
    # scheduled at once, half the budget or more each step; its prompt done in four steps and
    # its first token decoded in the fifth (before the fix: [0, 0, 0, 0, 0])
    assert min(taken[:3]) >= 256 and sum(taken[:4]) == 1000, taken
    assert taken[4] == 1, taken


def test_generation_does_not_starve_prompt_only_requests():
    """The other way round: 64 long generations hold every slot; embedding requests that
    arrive get slots within a few steps (the lanes share the seats)."""
    pool = BlockPool(4000, 16, prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=512)
    for i in range(64):
        req = EngineRequest(f"g{i}", (1, 2, 3), SamplingParams(max_tokens=500), group=f"G{i}")
        sched.add(Sequence(req, 600, frozenset()))
    for _ in range(3):
        _step(sched)
    assert len(sched.running) == 64
    _prompt_flood(sched, 10, 24)
    done = set()
    for _ in range(6):
        done |= {ch.seq.request_id for ch in _step(sched) if ch.seq.score_only}
    assert done == {f"e{i}" for i in range(10)}, done
