"""Whatever a user points `--model` at gets a one-line answer, and a served model says what
runs how: the file checks, `--runner paged` on a family it cannot run, the operator's
`--chat-template`, the architecture, runner and weight formats on /health and /v1/models, and a
GGUF file's first start, which makes no float32 copy of what it serves in blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_util import free_port, running_state

from probserve.api.answers.tokens import TokenTable
from probserve.models import LoadedModel
from probserve.models.loader import embedded_gguf_path

pytestmark = pytest.mark.slow

PROBSERVE = [sys.executable, "-m", "probserve.cli"]


def _one_line_refusal(args: list[str], names: str) -> str:
    if args[0] == "serve":  # a port of its own: `serve` checks its port before the model
        args = [*args, "--port", str(free_port())]
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
        assert facts["device"] == "cpu" and facts["precision"] == "exact"
        assert facts["weights"] == "Q4_1+Q8_0"
        assert 0.99 < facts["weights_in_blocks"] <= 1.0  # only the norms are float32
        # the kernels' own word on their instruction path (the widest this CPU has)
        flags = Path("/proc/cpuinfo").read_text()
        widest = "avx2" if " avx512f" not in flags else "avx512"
        widest += "-vnni" if " avx512_vnni" in flags else ""
        assert facts["kernel_isa"] == widest


_PEAK_SCRIPT = """
import json, sys
from probserve.engine.config import EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.models.loader import loaded_source
loaded = loaded_source(sys.argv[1], "native")[1]
core = EngineCore(loaded, EngineConfig(kv_cache_gib=0.05))
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"hwm": peak * 1024, "weights": loaded.weights_format,
                  "share": loaded.weights_in_blocks}))
"""


def _first_start(spec: str, cache: Path) -> dict:
    """A first start of `spec` in a fresh cache, but with the session's built kernels (a build
    is a compiler's memory, not the server's, and a minute on a 2-core machine)."""
    from probserve.kernels.build import build

    cache.mkdir()
    (cache / "kernels").symlink_to(build().parent, target_is_directory=True)
    env = {**os.environ, "PROBSERVE_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, spec],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_native_first_start_makes_no_float32_copy(tmp_path: Path):
    """The first start of a GGUF file (fresh cache) peaks at the embedded model's first start
    plus, at most, the larger file's extra size (+15%): no float32 copy of the weights is made
    (before, a 289 MB Q8_0 file went through a ~1.1 GB float32 model, twice). The cache holds
    metadata and the file's own rows only; a float16 matrix stays float16 in it."""
    from gguf_util import write_llama_gguf

    big = write_llama_gguf(
        tmp_path / "big.gguf", hidden=1024, layers=12, ffn=4096, heads=16, kv_heads=4,
        half=("blk.0.ffn_down",),
    )  # fmt: skip
    small = embedded_gguf_path()
    base = _first_start(str(small), tmp_path / "cache-small")
    grown = _first_start(str(big), tmp_path / "cache-big")
    extra = big.stat().st_size - small.stat().st_size
    assert grown["hwm"] - base["hwm"] < 1.15 * extra, (base, grown, extra)
    print("first-start peaks", base, grown, "extra file bytes", extra)
    assert grown["weights"] == "Q8_0" and 0.97 < grown["share"] < 0.99  # one float16 matrix
    models = tmp_path / "cache-big" / "models"
    (meta,) = [d for d in models.iterdir() if d.is_dir()]
    assert not list(meta.glob("*.safetensors")) and (meta / "tokenizer.json").is_file()
    assert not meta.with_name(meta.name + ".float32").exists()  # float32 is not served
    blocks = meta.with_name(meta.name + ".blocks.safetensors")
    assert blocks.stat().st_size < 1.01 * big.stat().st_size  # the file's rows, no float32
    with blocks.open("rb") as f:
        head = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert head["model.layers.0.mlp.down_proj.weight"]["dtype"] == "F16"


def test_a_load_parses_a_gguf_files_header_once(tmp_path: Path):
    """Within parsed_once() a file's reader is its first parse (transformers and the blocks
    reader each ask for one); outside, gguf's own class again, so nothing outlives the load."""
    import gguf
    import numpy as np

    from probserve.models.gguf_once import parsed_once, release_pages

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("w", np.ones((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        with parsed_once():
            assert gguf.GGUFReader(tmp_path / "." / "m.gguf") is first
        release_pages(path)  # the pages go; the parse stays and reads them again
        assert gguf.GGUFReader(path) is first and first.tensors[0].data.sum() == 64
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader
    assert gguf.GGUFReader(path) is not first
