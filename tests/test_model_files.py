"""Whatever a user points `--model` at gets a one-line answer, and a served model says what
runs how: the file checks, `--runner paged` on a family it cannot run, the operator's
`--chat-template`, and the architecture, runner and weight formats on /health and /v1/models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_util import running_state

from probserve.api.tokens import TokenTable
from probserve.models import LoadedModel
from probserve.models.loader import embedded_gguf_path

pytestmark = pytest.mark.slow

PROBSERVE = [sys.executable, "-m", "probserve.cli"]


def _one_line_refusal(args: list[str], names: str) -> str:
    proc = subprocess.run(
        [*PROBSERVE, *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("probserve: error:")]
    assert len(errors) == 1 and names in errors[0], out[-3000:]
    return errors[0]


def test_files_that_are_no_model_are_one_line_each(tmp_path: Path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model\n")
    line = _one_line_refusal(["serve", "--model", str(text)], str(text))
    assert "not a GGUF file" in line
    cut = tmp_path / "cut.gguf"
    data = embedded_gguf_path().read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert "truncated" in _one_line_refusal(["serve", "--model", str(cut)], str(cut))
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:10])
    assert "truncated" in _one_line_refusal(["serve", "--model", str(header)], str(header))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    line = _one_line_refusal(["serve", "--model", str(weights)], str(weights))
    assert "is a file, not a model" in line
    missing = tmp_path / "nothing.jinja"
    assert "cannot read" in _one_line_refusal(
        ["serve", "--chat-template", str(missing)], str(missing)
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    assert "not valid Jinja" in _one_line_refusal(
        ["serve", "--chat-template", str(broken)], str(broken)
    )


def test_the_paged_runner_refuses_a_family_it_cannot_run(smol: LoadedModel, tmp_path: Path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=smol.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).eval().save_pretrained(tmp_path)
    smol.tokenizer.save_pretrained(tmp_path)
    line = _one_line_refusal(
        ["generate", "Hi", "--model", str(tmp_path), "--runner", "paged"], "--runner paged"
    )
    assert "gpt2" in line


def test_the_operators_chat_template_is_the_one_used(smol: LoadedModel, tmp_path: Path):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    with running_state(smol, "--chat-template", str(template)) as (url, _):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        rendered = "[user] What is the capital of France?\n[assistant] "
        ids = smol.tokenizer(rendered, add_special_tokens=False).input_ids
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        tok = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()
        assert tok["tokens"] == ids
        # " What" carries the template's space: still the message's word
        sources = r.json()["choices"][0]["prompt_token_sources"]
        table = TokenTable(smol.tokenizer, smol.vocab_size)
        mine = "".join(
            table.decode([t]) for t, s in zip(ids, sources, strict=True) if s["message_index"] == 0
        )
        assert mine == " What is the capital of France?"
    loops = tmp_path / "loops.jinja"  # transformers' own extensions (loopcontrols) compile
    loops.write_text(
        "{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    with running_state(smol, "--chat-template", str(loops)) as (url, _):
        r = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
    assert smol.tokenizer.chat_template != template.read_text()  # the model given is untouched


def test_health_and_model_cards_say_what_runs_how(http):
    health = http.get("/health").json()
    cards = http.get("/v1/models").json()["data"]
    for facts in (health, cards[0]):
        assert facts["architecture"] == "llama"
        assert facts["runner"] == "PagedRunner" and facts["deterministic"] is True
        assert facts["weights"] == "Q4_1+Q8_0"
        assert 0.99 < facts["weights_in_blocks"] <= 1.0  # only the norms are float32
