"""The command line as operators use it: `python -m probserve`, --version, a --config file of
serve flags, PROBSERVE_<FLAG> variables, a positional model, grouped --help with defaults,
vLLM's spellings, --max-model-len."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from probserve import __version__
from probserve.cli import build_parser, main, with_presets
from probserve.engine import EngineConfig, LogprobsMode
from probserve.engine.core.engine import EngineCore
from probserve.flags import PresetError
from probserve.models import LoadedModel
from probserve.settings import SERVE_SETTINGS, ServeSettings


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Any:
    parser = build_parser()
    return parser.parse_args(with_presets(parser, argv, environ or {}))


@pytest.mark.slow  # it starts `python -m probserve` (make test-fast starts no process)
def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"probserve {__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "probserve", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"probserve {__version__}"


def _other_value(f: dataclasses.Field[Any], hint: Any) -> tuple[Any, list[str]]:
    """A value for flag `f` that is not its default: (as YAML, as command-line tokens)."""
    flag = "--" + f.name.replace("_", "-")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return (not f.default), [flag if not f.default else "--no-" + flag[2:]]
    if origin is tuple:
        return ["a1", "b2"], [flag, "a1", flag, "b2"]
    item = hint
    if origin in (typing.Union, types.UnionType):  # X | None
        item = next(a for a in args if a is not type(None))
    if typing.get_origin(item) is typing.Literal:
        choice = next(c for c in typing.get_args(item) if c != f.default)
        return choice, [flag, str(choice)]
    if isinstance(item, type) and issubclass(item, enum.Enum):
        choice = next(m.value for m in item if m != f.default)
        return choice, [flag, choice]
    if item is int:
        value: Any = (f.default or 0) + 3
    elif item is float:
        value = (f.default or 0.0) + 0.25
    else:
        value = "some-value"
    return value, [flag, str(value)]


def test_config_file_with_every_flag_equals_the_command_line(tmp_path: Path) -> None:
    file_values: dict[str, Any] = {}
    tokens: list[str] = []
    for cls in SERVE_SETTINGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata or f.name == "config":
                continue
            value, flag_tokens = _other_value(f, hints[f.name])
            file_values[f.name.replace("_", "-")] = value
            tokens += flag_tokens
    assert len(file_values) > 50
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(file_values), encoding="utf-8")
    from_file = vars(parse(["serve", "--config", str(path)]))
    from_flags = vars(parse(["serve", *tokens]))
    from_file.pop("config"), from_flags.pop("config")
    assert from_file == from_flags
    defaults = vars(parse(["serve"]))
    assert all(
        from_file[k] != defaults[k] for k in from_file if k not in ("command", "func", "model_tag")
    )


def test_precedence_command_line_then_environment_then_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_seqs: 4\nport: 9100\nmodel: [a, b]\nprefix-caching: false\n")
    args = parse(["serve", "--config", str(path)])
    assert (args.max_num_seqs, args.port, args.model, args.prefix_caching) == (
        4,
        9100,
        ["a", "b"],
        False,
    )
    env = {"PROBSERVE_MAX_NUM_SEQS": "8", "PROBSERVE_PREFIX_CACHING": "yes"}
    args = parse(["serve", "--config", str(path)], env)
    assert (args.max_num_seqs, args.port, args.prefix_caching) == (8, 9100, True)
    args = parse(["serve", "--config", str(path), "--max-num-seqs=2", "--model", "c"], env)
    assert (args.max_num_seqs, args.model) == (2, ["c"])  # a repeated flag is replaced, not added
    args = parse(["serve", "--no-enable-prefix-caching"], env)  # an alias counts as given
    assert args.prefix_caching is False
    args = parse(["serve"], {"PROBSERVE_MODEL": "x.gguf,y.gguf", "PROBSERVE_TEST_SERVER": "ray"})
    assert args.model == ["x.gguf", "y.gguf"]


@pytest.mark.parametrize(
    ("text", "env", "says"),
    [
        ("max_num_seqs: 4\nno_such_flag: 1\n", {}, "no_such_flag"),
        ("- a\n- b\n", {}, "not a mapping"),
        ("port: [1, 2]\n", {}, "not one value"),
        ("", {"PROBSERVE_DETERMINISTIC": "maybe"}, "PROBSERVE_DETERMINISTIC"),
        ("max_num_seqs: [\n", {}, "cannot read"),
    ],
)
def test_bad_presets_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, env: dict[str, str], says: str
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(PresetError, match=says):
        parse(["serve", "--config", str(path)], env)
    old = dict(os.environ)
    os.environ.update(env)
    try:
        assert main(["serve", "--config", str(path)]) == 2
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert says in capsys.readouterr().err


def test_a_bad_preset_value_fails_as_the_flag_would(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse(["serve"], {"PROBSERVE_MAX_NUM_SEQS": "many"})
    with pytest.raises(SystemExit):
        parse(["serve"], {"PROBSERVE_RUNNER": "fastest"})


def test_the_ray_cluster_file_under_config_is_taken_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("models:\n  - model: smollm2-135m-instruct\n    num_replicas: 2\n")
    with caplog.at_level(logging.WARNING):
        args = parse(["serve", "--ray", "--config", str(path)])
    assert args.cluster_config == str(path)
    assert "deprecated" in caplog.text and "--cluster-config" in caplog.text


def _specs(args: object) -> list[str]:
    return [m.spec for m in ServeSettings.of(args).models]  # type: ignore[arg-type]


def test_positional_model_comes_first() -> None:
    args = parse(["serve", "first.gguf", "--model", "second.gguf"])
    assert _specs(args) == ["first.gguf", "second.gguf"]
    args = parse(["serve", "only.gguf"], {"PROBSERVE_MODEL": "from-env.gguf"})
    assert _specs(args) == ["only.gguf"]
    assert _specs(parse(["serve"])) == ["smollm2-135m-instruct"]


def test_help_is_grouped_with_defaults() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for heading in ("model:", "server:", "logprobs:", "limits:", "engine:", "Ray:"):
        assert f"\n{heading}\n" in text
    assert "sequences decoded together in one batch (default: 64)" in " ".join(text.split())
    assert "PROBSERVE_<FLAG>" in text


def test_vllm_spellings() -> None:
    assert parse(["serve", "--no-enable-prefix-caching"]).prefix_caching is False
    assert parse(["serve", "--enable-prefix-caching"]).prefix_caching is True
    assert parse(["serve", "--logprobs-mode", "processed_logprobs"]).logprobs_mode == "processed"
    assert LogprobsMode("raw_logprobs") is LogprobsMode.RAW
    with pytest.raises(SystemExit):
        parse(["serve", "--logprobs-mode", "raw_logits"])


def test_vllm_logprobs_modes_in_a_request() -> None:
    from pydantic import ValidationError

    from probserve.api.protocol import CompletionRequest

    body = {"model": "m", "prompt": "x", "logprobs_mode": "processed_logprobs"}
    assert CompletionRequest.model_validate(body).logprobs_mode is LogprobsMode.PROCESSED
    with pytest.raises(ValidationError, match="logits"):
        CompletionRequest.model_validate({**body, "logprobs_mode": "raw_logits"})


def test_max_model_len_caps_the_context(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(max_model_len=100, kv_cache_gib=0.05))
    assert core.info.context_length == 100 and core.info.max_context <= 100
    assert EngineCore(tiny, EngineConfig(kv_cache_gib=0.05)).info.context_length == 256
    with pytest.raises(ValueError, match="max-model-len 257"):
        EngineCore(tiny, EngineConfig(max_model_len=257))


def test_usable_cores_without_an_affinity_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from probserve.engine.core import host

    assert host.usable_cores() >= 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert host.usable_cores() == (os.cpu_count() or 1)


def test_a_draft_model_goes_with_its_model_and_the_draft_mode() -> None:
    """`--draft-model` pairs with `--model` by position and only with `--speculative draft`;
    the draft model is a model setting, never part of the engine's configuration."""
    from probserve.models import ModelLoadError

    args = parse(["serve", "a.gguf", "--model", "b.gguf", "--speculative", "draft",
                  "--draft-model", "da.gguf", "--draft-model", "db.gguf"])  # fmt: skip
    settings = ServeSettings.of(args)
    assert [(m.spec, m.draft) for m in settings.models] == [
        ("a.gguf", "da.gguf"), ("b.gguf", "db.gguf"),
    ]  # fmt: skip
    assert settings.engine.speculative == "draft"
    assert not [f.name for f in dataclasses.fields(EngineConfig) if "draft" in f.name]
    for argv in (
        ["serve", "a.gguf", "--speculative", "draft"],
        ["serve", "a.gguf", "--model", "b.gguf", "--speculative", "draft", "--draft-model", "d"],
        ["serve", "a.gguf", "--draft-model", "d"],
        ["serve", "a.gguf", "--speculative", "ngram", "--draft-model", "d"],
    ):
        with pytest.raises(ModelLoadError, match="--draft-model"):
            ServeSettings.of(parse(argv))
