"""Models by name (models/hub.py) against a local double of the Hugging Face hub (hub_double.py,
through HF_ENDPOINT; never the internet): `probserve pull org/repo:QUANT` with progress lines
and a download resumed after the connection drops, the one-line errors (no such quantization,
no such repository, no network, offline mode), `probserve list`, a split GGUF joined into one
file, a safetensors repository, and `probserve serve org/repo:QUANT` answering as the same file
served from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hub_double import COMMIT, HubDouble, running_hub
from server_util import free_port

from probserve.models.errors import ModelLoadError
from probserve.models.hub import HubName, RepoFile, _choose, gguf_groups, quant_of
from probserve.models.sources import embedded_gguf_path

PROBSERVE = str(Path(sys.executable).parent / "probserve")
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


def test_names_and_quantizations() -> None:
    assert HubName.parse("org/repo") == HubName("org/repo", None)
    assert HubName.parse("bartowski/Qwen3-8B-GGUF:q4_k_m") == HubName(
        "bartowski/Qwen3-8B-GGUF", "q4_k_m"
    )
    for not_a_name in ("model.gguf", "a/b/c", "org/", "/abs/path", "org/repo:", "x"):
        assert HubName.parse(not_a_name) is None, not_a_name
    assert quant_of("Qwen3-8B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("Q8_0/Qwen3-Q8_0-00001-of-00002.gguf") == "Q8_0"
    assert quant_of("gpt-oss-20b-mxfp4.gguf") == "MXFP4"
    assert quant_of("model.IQ3_XXS.gguf") == "IQ3_XXS"
    assert quant_of("model-bf16.gguf") == "BF16"
    files = [RepoFile(p, 1) for p in (
        "m-Q8_0.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
        "mmproj-m-f16.gguf", "README.md",
    )]  # fmt: skip
    groups = gguf_groups(files)
    assert sorted(groups) == ["Q4_K_M", "Q8_0"]
    assert groups["Q4_K_M"][0].path.endswith("00001-of-00002.gguf")
    assert _choose(HubName("o/m"), groups)[0] == "Q4_K_M"  # llama.cpp's default
    assert _choose(HubName("o/m", "q8_0"), groups)[0] == "Q8_0"
    with pytest.raises(ModelLoadError, match=r"no Q2_K GGUF file \(it has: Q4_K_M, Q8_0\)"):
        _choose(HubName("o/m", "Q2_K"), groups)
    only = gguf_groups([RepoFile("m-Q8_0.gguf", 1), RepoFile("m-F16.gguf", 1)])
    with pytest.raises(ModelLoadError, match="name one of its quantizations"):
        _choose(HubName("o/m"), only)
    # unsloth's dynamic quantizations beside the plain ones; a tag matched in a file's name
    ud = gguf_groups([RepoFile(p, 1) for p in (
        "Qwen3-8B-UD-Q4_K_XL.gguf", "Qwen3-8B-Q4_K_XL.gguf", "Qwen3-8B-IQ4_XS.gguf",
        "qwen3-8b.Q5_K_M.gguf",
    )])  # fmt: skip
    assert sorted(ud) == ["IQ4_XS", "Q4_K_XL", "Q5_K_M", "UD-Q4_K_XL"]
    assert _choose(HubName("o/m", "UD-Q4_K_XL"), ud)[1][0].path == "Qwen3-8B-UD-Q4_K_XL.gguf"
    assert _choose(HubName("o/m", "q4_k_xl"), ud)[1][0].path == "Qwen3-8B-Q4_K_XL.gguf"
    # a split model with a part missing is not a model
    partial = gguf_groups([RepoFile(f"m-Q8_0-0000{i}-of-00003.gguf", 1) for i in (1, 2)])
    with pytest.raises(ModelLoadError, match="split into 3 parts and 2 are there"):
        _choose(HubName("o/m", "Q8_0"), partial)


def split_gguf(source: Path, parts: list[Path]) -> None:
    """`source` as gguf-split writes it: the metadata in the first part, the tensors shared out,
    split.no / split.count / split.tensors.count in each."""
    reader = GGUFReader(str(source))
    tensors = list(reader.tensors)
    per = -(-len(tensors) // len(parts))
    arch = str(reader.get_field("general.architecture").contents())  # type: ignore[union-attr]
    for i, path in enumerate(parts):
        writer = GGUFWriter(str(path), arch=arch)
        if i == 0:
            for field in reader.fields.values():
                if field.name == "general.architecture" or field.name.startswith("GGUF."):
                    continue
                vtype = field.types[0]
                sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
                writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        writer.add_key_value("split.no", i, GGUFValueType.UINT16)
        writer.add_key_value("split.count", len(parts), GGUFValueType.UINT16)
        writer.add_key_value("split.tensors.count", len(tensors), GGUFValueType.INT32)
        mine = tensors[i * per : (i + 1) * per]
        for t in mine:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in mine:
            writer.write_tensor_data(t.data)
        writer.close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubDouble, str, Path]]:
    """The double, its URL and a repository name prefix unique to this run (the joined split
    file is kept in probserve's cache, named by its parts)."""
    double = HubDouble()
    embedded = embedded_gguf_path()
    run = uuid.uuid4().hex[:8]
    readme = tmp_path_factory.mktemp("repo") / "README.md"
    readme.write_text("# test repository\n")
    double.add(f"test-org/SmolLM2-{run}-GGUF", {FILE: embedded, "README.md": readme})
    parts_dir = tmp_path_factory.mktemp("split")
    parts = [parts_dir / f"Split-Q4_1-0000{i}-of-00002.gguf" for i in (1, 2)]
    split_gguf(embedded, parts)
    double.add(f"test-org/Split-{run}-GGUF", {f"Q4_1/{p.name}": p for p in parts})
    with running_hub(double) as url:
        yield double, url, Path(str(run))


def _env(url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": url, **extra}


def _probserve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROBSERVE, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_pull_resumes_shows_progress_lists_and_says_what_is_wrong(hub, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    double, url, run = hub
    repo = f"test-org/SmolLM2-{run}-GGUF"
    env = _env(url, tmp_path / "hf")
    double.cut_after[FILE] = 30_000_000  # the connection drops partway through
    double.bytes_per_second = 25e6  # a download of a few seconds
    pulled = _probserve(env, "pull", f"{repo}:Q4_1")
    double.bytes_per_second = 0
    assert pulled.returncode == 0, pulled.stderr
    (resumed,) = double.ranges(FILE)  # the second request asked for the rest only
    start = int(resumed.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 30_000_000
    assert "downloading " + FILE in pulled.stderr and "%" in pulled.stderr  # progress lines
    path = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT
    got = path / FILE
    assert got.read_bytes() == embedded_gguf_path().read_bytes()
    assert str(got) in pulled.stdout and f"probserve serve {repo}:Q4_1" in pulled.stdout
    # the errors: one line each, naming what there is
    wrong = _probserve(env, "pull", f"{repo}:Q5_K_M")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines()[-1] == (
        f"probserve: error: {repo} has no Q5_K_M GGUF file (it has: Q4_1)"
    )
    unknown = _probserve(env, "pull", "test-org/no-such-repo")
    assert unknown.returncode == 2 and "unknown repository test-org/no-such-repo" in unknown.stderr
    # the cache's list
    listed = _probserve(env, "list")
    assert listed.returncode == 0
    (line,) = [ln for ln in listed.stdout.splitlines() if ln.startswith(repo)]
    assert line.split()[:4] == [f"{repo}:Q4_1", "GGUF", "Q4_1", "98.4"]
    # offline: the cache answers alone; what it lacks is named
    offline = _env(url, tmp_path / "hf", HF_HUB_OFFLINE="1")
    again = _probserve(offline, "pull", f"{repo}:Q4_1")
    assert again.returncode == 0 and str(got) in again.stdout
    missing = _probserve(offline, "pull", "test-org/other")
    assert missing.returncode == 2 and "offline mode (HF_HUB_OFFLINE)" in missing.stderr
    # no network (nothing listens there): the same
    dead = _env(f"http://127.0.0.1:{free_port()}", tmp_path / "hf")
    cached = _probserve(dead, "pull", f"{repo}:Q4_1")
    assert cached.returncode == 0 and str(got) in cached.stdout
    unreachable = _probserve(dead, "pull", "test-org/other")
    assert unreachable.returncode == 2 and "no network" in unreachable.stderr


@pytest.mark.slow
def test_a_split_gguf_is_joined_into_one_file(hub, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, url, run = hub
    repo = f"test-org/Split-{run}-GGUF"
    # the joined file goes to a cache of the test's own, not the user's (a 98 MB file a run)
    env = _env(url, tmp_path / "hf", PROBSERVE_CACHE_DIR=str(tmp_path / "cache"))
    pulled = _probserve(env, "pull", repo)  # its only quantization
    assert pulled.returncode == 0, pulled.stderr
    joined = Path(pulled.stdout.split(", ")[2].splitlines()[0])
    assert joined.suffix == ".gguf" and joined.is_relative_to(tmp_path / "cache" / "joined")
    a, b = GGUFReader(str(embedded_gguf_path())), GGUFReader(str(joined))
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type)
                                                            for t in b.tensors]  # fmt: skip
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), x.name
    keys = {k for k in b.fields if not k.startswith("GGUF.")}
    assert keys == {k for k in a.fields if not k.startswith("GGUF.")}  # no split.* key left


@pytest.mark.slow
def test_a_safetensors_repository_is_its_snapshot(hub, tiny_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    double, url, run = hub
    repo = f"test-org/tiny-{run}"
    double.add(repo, {p.name: p for p in tiny_dir.iterdir() if p.is_file()})
    env = _env(url, tmp_path / "hf")
    pulled = _probserve(env, "pull", repo)
    assert pulled.returncode == 0, pulled.stderr
    assert "safetensors" in pulled.stdout and "float32 path" in pulled.stderr
    snapshot = Path(pulled.stdout.split(", ")[2].splitlines()[0])
    assert (snapshot / "config.json").is_file() and list(snapshot.glob("*.safetensors"))
    quant = _probserve(env, "pull", f"{repo}:Q4_K_M")
    assert quant.returncode == 2 and "not GGUF files: leave out :Q4_K_M" in quant.stderr
    listed = _probserve(env, "list").stdout
    assert any(ln.split()[:2] == [repo, "safetensors"] for ln in listed.splitlines())


@pytest.mark.slow
def test_serve_a_model_by_name(hub, tmp_path: Path, http) -> None:  # type: ignore[no-untyped-def]
    """`probserve serve org/repo:QUANT` pulls and serves it: the same answer, logprobs and all,
    as the same file served from disk (the session's server)."""
    from server_util import free_port

    _, url, run = hub
    name = f"test-org/SmolLM2-{run}-GGUF:Q4_1"
    port = free_port()
    env = _env(url, tmp_path / "hf", PROBSERVE_WORKER="inline")
    server = subprocess.Popen(
        [PROBSERVE, "serve", name, "--port", str(port)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"{base}/health", timeout=5).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert models[0]["id"] == name
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "logprobs": 3, "echo": True}  # fmt: skip
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"]
        want = http.post("/v1/completions", json=body).json()["choices"]
        assert got == want
    finally:
        server.terminate()
        server.wait(timeout=60)
