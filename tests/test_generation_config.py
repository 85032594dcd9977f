"""--generation-config: a model's generation_config.json gives the sampling defaults of the
fields a request leaves out (as vLLM), never overriding what a request sets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from probserve.api.plans.sampling import sampling_params
from probserve.api.protocol import CompletionRequest
from probserve.engine import SamplingParams
from probserve.models import ModelLoadError, ModelSource, load_model
from probserve.models.generation_config import SamplingDefaults, sampling_defaults


def _dir(tmp_path: Path, values: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **values}))
    return tmp_path


def test_the_files_sampling_values(tmp_path: Path) -> None:
    d = _dir(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    want = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert sampling_defaults(ModelSource(str(d)), "auto") == want
    assert sampling_defaults(None, str(d)) == want  # a directory named by the flag
    assert sampling_defaults(ModelSource(str(d)), "none") == SamplingDefaults()
    assert sampling_defaults(ModelSource(str(d)), "vllm") == SamplingDefaults()
    gguf = ModelSource(str(d), gguf_file="model.gguf")  # a file read in place: its own metadata
    assert sampling_defaults(gguf, "auto") == SamplingDefaults()
    with pytest.raises(ModelLoadError, match=r"no generation_config\.json"):
        sampling_defaults(None, str(tmp_path / "nowhere"))
    assert sampling_defaults(ModelSource(str(tmp_path / "empty")), "auto") == SamplingDefaults()


def _values(p: SamplingParams) -> tuple[float, ...]:
    return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty)


def test_a_request_keeps_what_it_sets() -> None:
    defaults = SamplingDefaults(
        temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.2
    )
    left_out = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert _values(sampling_params(left_out, 4, 100, None, defaults)) == (0.0, 0.5, 7, 0.1, 1.2)
    given = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
         "repetition_penalty": 1.0}
    )  # fmt: skip
    assert _values(sampling_params(given, 4, 100, None, defaults)) == (1.0, 1.0, 0, 0.0, 1.0)
    assert _values(sampling_params(left_out, 4, 100, None)) == (1.0, 1.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_served_defaults(tiny_dir: Path, tmp_path: Path, choice: str) -> None:
    from server_util import running_server

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    _dir(model_dir, {"temperature": 0.0})  # greedy unless a request says otherwise
    loaded = load_model(str(model_dir))
    args = ("--worker", "inline", "--generation-config", choice)
    with running_server(loaded, *args) as url:

        def text(**extra: object) -> str:
            body = {"model": loaded.name, "prompt": "Once upon a time", "max_tokens": 8,
                    "ignore_eos": True, **extra}  # fmt: skip
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        greedy = text(temperature=0.0)
        seeded = {text(seed=s) for s in range(4)}
        if choice == "auto":
            assert seeded == {greedy}  # the file's temperature 0
            assert len({text(seed=s, temperature=1.0) for s in range(4)}) > 1
        else:
            assert len(seeded) > 1  # OpenAI's temperature 1
