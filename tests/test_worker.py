"""The engine worker process and its wire protocol: round trips, version checks, another
architecture through the HF runner, death, stalls and the server's own exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from server_util import InFlight, finish_reason, free_port, running_state, wait_until

from probserve.engine import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    LogprobsMode,
    LogprobsSpec,
    RoutedExperts,
    RoutingSpec,
    SamplingParams,
    TokenLogprobs,
    wire,
)
from probserve.engine.info import EngineInfo
from probserve.engine.stats import EngineStats
from probserve.models import LoadedModel, ModelSource

PROBSERVE = [sys.executable, "-m", "probserve.cli"]
SMALL = ["--max-tokens", "3", "--kv-cache-gib", "0.01"]


def _logprobs(n: int, k: int, rng: np.random.Generator, nested: bool = True) -> TokenLogprobs:
    return TokenLogprobs(
        token_ids=rng.integers(0, 49152, n),
        logprobs=rng.standard_normal(n).astype(np.float32),
        ranks=rng.integers(1, 100, n),
        top_ids=rng.integers(0, 49152, (n, k)),
        top_logprobs=rng.standard_normal((n, k)).astype(np.float32),
        target_logprobs=rng.standard_normal((n, 3)).astype(np.float32),
        target_ids=(5, 6, 7),
        entropy=np.full(n, -np.inf, dtype=np.float32),
        processed=_logprobs(n, k, rng, nested=False) if nested else None,
        full=rng.standard_normal((1, 17)).astype(np.float32) if nested else None,
    )


def _assert_same(a: TokenLogprobs | None, b: TokenLogprobs | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    for name in ("target_logprobs", "entropy", "full"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.target_ids == b.target_ids
    _assert_same(a.processed, b.processed)


def test_every_message_round_trips_bit_for_bit():
    rng = np.random.default_rng(7)
    commands, events = wire.Codec(wire.Command), wire.Codec(wire.Event)
    req = EngineRequest(
        "r-1",
        (1, 2, 3),
        SamplingParams(temperature=0.5, seed=2**64 - 1, logit_bias={7: -100.0}, max_tokens=None),
        LogprobsSpec(top_k=3, prompt_top_k=0, mode=LogprobsMode.BOTH, target_ids=(9,)),
        group="g",
        routing=RoutingSpec(prompt=True),
    )
    for message in (
        wire.Submit(requests=[req, EngineRequest("r-2", (4,))]),
        wire.Abort(request_ids=["r-1"]),
        wire.Shutdown(),
    ):
        assert commands.decode(commands.encode(message)) == message
    outputs = [
        EngineOutput(
            "r-1",
            (42,),
            _logprobs(1, 3, rng),
            _logprobs(2, 0, rng),
            FinishReason.STOP,
            queue_time=0.25,
            routed=RoutedExperts(
                rng.integers(0, 128, (1, 3, 8)).astype(np.int16),
                rng.random((1, 3, 8), dtype=np.float32),
            ),
            prompt_routed=RoutedExperts(
                np.zeros((0, 3, 8), np.int16), np.zeros((0, 3, 8), np.float32)
            ),
        ),
        EngineOutput.failure("r-2", "a lone \ud800 surrogate, and ✓"),
        EngineOutput("r-3"),
    ]
    stats = EngineStats(running=2, iteration_tokens=(1,) * 13, process_cpu_seconds=0.5)
    back = events.decode(events.encode(wire.StepOutputs(outputs=outputs, stats=stats)))
    assert isinstance(back, wire.StepOutputs) and back.stats == stats
    assert outputs[1].error == "a lone \\ud800 surrogate, and ✓"  # kept valid UTF-8
    for a, b in zip(outputs, back.outputs, strict=True):
        assert (a.request_id, a.new_token_ids, a.finish_reason, a.error, a.queue_time) == (
            b.request_id,
            b.new_token_ids,
            b.finish_reason,
            b.error,
            b.queue_time,
        )
        _assert_same(a.logprobs, b.logprobs)
        _assert_same(a.prompt_logprobs, b.prompt_logprobs)
        for x, y in ((a.routed, b.routed), (a.prompt_routed, b.prompt_routed)):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.experts.dtype == y.experts.dtype and x.weights.dtype == y.weights.dtype
                assert np.array_equal(x.experts, y.experts) and x.experts.shape == y.experts.shape
                assert x.weights.tobytes() == y.weights.tobytes()
    hello = wire.Hello(
        info=EngineInfo(
            49152,
            8192,
            8192,
            (0, 2),
            "PagedRunner",
            1024,
            True,
            moe_layers=(0, 2),
            experts_per_token=8,
        ),
        model="/m",
        pid=1,
        startup_seconds=1.5,
    )
    assert events.decode(events.encode(hello)) == hello


def test_another_version_or_garbage_is_refused():
    events = wire.Codec(wire.Event)
    other = wire.VERSION + 1
    raw = msgspec.msgpack.encode({"type": "failed", "v": other, "reason": "x"})
    with pytest.raises(wire.ProtocolError, match=f"version {other}"):
        events.decode(raw)
    with pytest.raises(wire.ProtocolError):
        events.decode(b"\xc1 not msgpack")
    with pytest.raises(wire.ProtocolError):  # a command is not an event
        events.decode(wire.Codec(wire.Command).encode(wire.Shutdown()))


def _children(pid: int) -> list[int]:
    """The child processes of `pid`, whichever of its threads started them."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        return []
    return sorted(int(x) for t in tasks.iterdir() for x in (t / "children").read_text().split())


@pytest.mark.slow
def test_worker_answers_as_the_inline_engine(smol: LoadedModel):
    body = {
        "prompt": "The three primary colours are",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 5,
        "echo": True,
    }
    answers = []
    for mode in ("process", "inline"):
        # deterministic (the default): the same kernels in both, so the same bits
        with running_state(smol, "--worker", mode) as (url, state):
            assert (state.default.engine.__class__.__name__ == "WorkerEngine") == (
                mode == "process"
            )
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).json())
    a, b = (x["choices"][0] for x in answers)
    assert a["text"] == b["text"]
    assert a["logprobs"] == b["logprobs"]


@pytest.fixture(scope="module")
def gpt2_dir(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 (not the Llama family: the HF runner serves it) with SmolLM2's
    tokenizer, saved as a plain Hugging Face directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    config = GPT2Config(vocab_size=smol.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).eval().save_pretrained(path)
    smol.tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_gpt2_model_runs_on_the_hf_runner(gpt2_dir: Path):
    out = subprocess.run(
        [*PROBSERVE, "generate", "Hello", "--model", str(gpt2_dir), "--runner", "hf", *SMALL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finish_reason: length" in out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_gpt2_worker_serves_every_logprobs_feature(smol: LoadedModel, gpt2_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).eval()
    gpt2 = LoadedModel(
        model=None,
        tokenizer=smol.tokenizer,
        name="gpt2-tiny",
        eos_token_ids=frozenset(),
        context_length=128,
        vocab_size=smol.vocab_size,
        source=ModelSource(str(gpt2_dir), None, "gpt2-tiny"),
    )
    with running_state(gpt2, "--kv-cache-gib", "0.01") as (url, state):
        assert state.default.engine.info.runner == "HFRunner"
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 2}
        r = httpx.post(f"{url}/v1/completions", json={**body, "echo": True}, timeout=60)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
    ids = smol.tokenizer("Hello there")["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    np.testing.assert_allclose(lp["token_logprobs"][1 : len(ids)], expected, atol=1e-4)


@pytest.mark.slow
def test_a_stalled_worker_is_stuck_and_a_killed_one_dead(smol: LoadedModel):
    with running_state(smol, "--engine-stall-timeout", "1") as (url, state):
        eng = state.default.engine
        assert eng.pid is not None
        fatal: list[str] = []
        eng.on_fatal = fatal.append
        long = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=long) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # tokens are flowing
            os.kill(eng.pid, signal.SIGSTOP)
            try:

                def stuck() -> bool:  # one answer says both
                    h = c.get("/health")
                    return h.status_code == 503 and h.json()["status"] == "stuck"

                assert wait_until(stuck, 10)
            finally:
                os.kill(eng.pid, signal.SIGCONT)
            assert wait_until(lambda: c.get("/health").json()["status"] == "ok", 10)
            os.kill(eng.pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln]
        assert any('"error"' in ln for ln in rest), rest[-3:]  # the stream ends with an error
        assert rest[-1] == "data: [DONE]"
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and h.json()["status"] == "dead", h.text
        assert wait_until(lambda: fatal, 10) and "exited" in fatal[0]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


@pytest.fixture
def served(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`probserve serve` as a user starts it (its own process, a worker beside it), with the
    extra flags of an indirect parameter."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [
            *PROBSERVE,
            "serve",
            "--port",
            str(port),
            "--kv-cache-gib",
            "0.25",
            *getattr(request, "param", ()),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert wait_until(up, 300) and proc.poll() is None, (tmp_path / "serve.log").read_text()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("served", [("--worker-restarts", "0")], indirect=True)
def test_the_server_exits_non_zero_when_its_worker_dies(served):
    proc, url = served
    (worker,) = _children(proc.pid)
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    os.kill(worker, signal.SIGKILL)
    assert proc.wait(timeout=60) == 1


@pytest.mark.slow
def test_a_dead_worker_is_restarted_and_answers_as_before(served):
    """/health tells the truth at its first poll after the worker has died (not once the
    supervisor has noticed), then the restarted worker answers exactly as the first did."""
    proc, url = served
    (worker,) = _children(proc.pid)
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    before = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: _gone(worker), 15)  # dead as the kernel sees it (a zombie or reaped)
    seen: list[str] = []

    def back() -> bool:
        h = httpx.get(f"{url}/health", timeout=5)
        status = h.json()["status"]
        assert (h.status_code == 200) == (status == "ok"), h.text
        if not seen or seen[-1] != status:
            seen.append(status)
        return h.status_code == 200

    assert not back(), seen  # the first poll after the death already says so
    assert seen[0] in ("dead", "restarting"), seen
    assert wait_until(back, 120), seen
    assert seen[-1] == "ok" and "ok" not in seen[:-1], seen  # down, then back, in that order
    (fresh,) = _children(proc.pid)
    assert fresh != worker and proc.poll() is None
    after = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert after == before


@pytest.mark.slow
def test_the_server_process_never_loads_torch(served, smol: LoadedModel):
    """The API process parses, tokenizes and formats; torch (~200 MB) lives in the worker
    alone. Its tokenizer, loaded by the class the worker's AutoTokenizer chose, tokenizes as
    that one does, chat template included."""
    proc, url = served
    (worker,) = _children(proc.pid)
    messages = [{"role": "user", "content": "Name a colour. Ünïcödé, 中文, emoji 🙂"}]
    chat = {"messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    template = smol.tokenizer.apply_chat_template
    expected = template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    text = "Ünïcödé   spaces\n\ttabs, 中文 and 🙂"
    tok = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()
    assert tok["tokens"] == smol.tokenizer(text)["input_ids"]

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "libtorch" not in maps(proc.pid)
    assert "libtorch" in maps(worker)


@pytest.mark.slow
def test_the_worker_goes_when_its_server_is_killed(served):
    proc, _ = served
    (worker,) = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert wait_until(lambda: _gone(worker), 15)


@pytest.mark.slow
def test_sigterm_drains_and_stops_the_worker(served):
    proc, url = served
    (worker,) = _children(proc.pid)
    flight = InFlight(url, {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True})
    assert flight.started.wait(60)  # its first token is out: the request is in flight
    proc.send_signal(signal.SIGTERM)
    status, events, done = flight.join()
    assert status == 200 and done and finish_reason(events) == "length"  # it finished
    assert proc.wait(timeout=60) == 0
    assert wait_until(lambda: _gone(worker), 15)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as gone)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] == "Z"
