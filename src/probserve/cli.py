"""The `probserve` command: `generate` (one prompt, printed with its logprobs), `export`,
`serve`, `pull` (a model from the Hugging Face hub by name into its cache) and `list` (what
the cache holds), each flag settable by a `--config` file (serve) or a PROBSERVE_<FLAG>
variable."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from probserve import __version__
from probserve.engine import (
    EngineConfig,
    EngineDead,
    EngineRequest,
    LogprobsMode,
    LogprobsSpec,
    SamplingParams,
)
from probserve.flags import HelpFormatter, PresetError, add_args, from_args, presets, setting
from probserve.logs import configure_logging
from probserve.models import DEFAULT_MODEL, MODEL_HELP, ModelLoadError, ModelRecord, load_model


@dataclass(frozen=True)
class GenerateFlags:
    """`probserve generate`'s flags (the engine's too: EngineConfig)."""

    prompt: str = setting("", "the prompt to complete", positional=True)
    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    draft_model: str | None = setting(
        None, "--speculative draft: the draft model (a smaller one with the same tokenizer)"
    )
    max_tokens: int = setting(16, "tokens to generate at most")
    temperature: float = setting(0.0, "0: greedy")
    top_p: float = setting(1.0, "nucleus sampling's probability mass")
    seed: int | None = setting(None, "the sampling seed")
    logprobs: int = setting(5, "alternatives shown per token")
    logprobs_mode: LogprobsMode = setting(
        LogprobsMode.RAW, "raw (the model's distribution), processed (the sampled one), both"
    )


@dataclass(frozen=True)
class ExportFlags:
    """`probserve export`'s flags."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    directory: str = setting("", "where to write the HF directory", positional=True)


class UsageError(ValueError):
    """Flags that do not go together."""


def _fmt(lp: float) -> str:
    return "-inf" if math.isinf(lp) else f"{lp:.4f}"


async def _generate(args: argparse.Namespace) -> int:
    from probserve.api.answers.tokens import TokenTable, token_text
    from probserve.api.prompts import build_completion_prompts
    from probserve.engine import AsyncEngine

    flags, config = from_args(GenerateFlags, args), from_args(EngineConfig, args)
    loaded = load_model(flags.model, config.weights_to_load())
    draft = load_model(flags.draft_model, config.weights_to_load()) if flags.draft_model else None
    table = TokenTable(loaded.tokenizer, loaded.vocab_size)
    engine = AsyncEngine.over(loaded, config, draft=draft)
    record = ModelRecord.of(loaded)
    (prompt,) = build_completion_prompts(record, table, [flags.prompt], engine.info.max_context)
    request = EngineRequest(
        request_id=AsyncEngine.new_request_id("cli"),
        prompt_token_ids=tuple(prompt.ids),
        sampling=SamplingParams(
            temperature=flags.temperature,
            top_p=flags.top_p,
            seed=flags.seed,
            max_tokens=flags.max_tokens,
        ),
        logprobs=LogprobsSpec(top_k=flags.logprobs, mode=flags.logprobs_mode),
    )
    try:
        outputs = await engine.generate(request)
    finally:
        engine.stop()
    ids = [t for out in outputs for t in out.new_token_ids]
    out_text = table.decode([t for t in ids if t not in loaded.eos_token_ids])
    print(flags.prompt + out_text)
    print()
    print(f"{'token':<20} {'logprob':>10}  top-{flags.logprobs}")
    for out in outputs:
        if out.logprobs is None:
            continue
        lp = out.logprobs
        for j in range(len(lp)):
            tok = token_text(table.token_bytes(int(lp.token_ids[j])), legacy_prefix=True)
            alts = ", ".join(
                f"{token_text(table.token_bytes(int(i)), True)!r}: {_fmt(float(v))}"
                for i, v in zip(lp.top_ids[j], lp.top_logprobs[j], strict=True)
            )
            print(f"{tok!r:<20} {_fmt(float(lp.logprobs[j])):>10}  {{{alts}}}")
    print(f"\nfinish_reason: {outputs[-1].finish_reason}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from probserve.models import save_hf_directory

    flags = from_args(ExportFlags, args)
    out = save_hf_directory(load_model(flags.model), flags.directory)
    print(f"wrote {out}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _pull(args: argparse.Namespace) -> int:
    from probserve.models.hub import HubName, pull

    for noisy in ("httpx", "httpx2"):  # a line per request: the stage's lines say enough
        logging.getLogger(noisy).setLevel(logging.WARNING)
    name = HubName.parse(args.name)
    if name is None:
        raise UsageError(f"{args.name!r} is not a model name: org/repo or org/repo:QUANT")
    pulled = pull(name)
    size = (
        sum(f.stat().st_size for f in pulled.path.rglob("*") if f.is_file())
        if (pulled.path.is_dir())
        else pulled.path.stat().st_size
    )
    print(f"{name}: {pulled.format}, {_size(size)}, {pulled.path}")
    print(f"serve it: probserve serve {name}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from probserve.models.hub import cached_models

    models = cached_models()
    if not models:
        print("no models in the Hugging Face cache (HF_HOME); get one: probserve pull org/repo")
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':<{width}}  {'FORMAT':<16} {'SIZE':>9}  PATH")
    for m in models:
        print(f"{m.name:<{width}}  {m.format:<16} {_size(m.size):>9}  {m.path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from probserve.serving import run_server
    from probserve.settings import ServeSettings

    settings = ServeSettings.of(args)  # every setting parsed once, here
    flags = settings.flags
    if bool(flags.ssl_keyfile) != bool(flags.ssl_certfile):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together")
    if flags.ray and flags.ssl_keyfile:
        raise UsageError("--ssl-keyfile is not available with --ray (Ray Serve's proxy serves)")
    if flags.ray:
        from probserve.cluster.app import run_cluster

        if flags.chat_template:
            raise ModelLoadError("--chat-template is not available with --ray")
        return run_cluster(settings)
    return run_server(settings)


def build_parser() -> argparse.ArgumentParser:
    from probserve.settings import add_serve_args

    parser = argparse.ArgumentParser(prog="probserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"probserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print each token's logprobs",
        formatter_class=HelpFormatter,
    )
    add_args(gen, GenerateFlags)
    add_args(gen, EngineConfig)
    gen.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    export = sub.add_parser(
        "export",
        help="write the model's float32 weights and tokenizer as a plain HF directory",
        formatter_class=HelpFormatter,
    )
    add_args(export, ExportFlags)
    export.set_defaults(func=_export)

    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI API",
        description="Serve the OpenAI API. Every flag can also be set by a PROBSERVE_<FLAG> "
        "environment variable (PROBSERVE_MAX_NUM_SEQS=8) or a --config file's key; the command "
        "line wins.",
        formatter_class=HelpFormatter,
    )
    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    pull = sub.add_parser(
        "pull",
        help="download a model from the Hugging Face hub into its cache (HF_HOME), as serve "
        "would: org/repo[:QUANT] (a GGUF quantization, Q4_K_M by default; or safetensors)",
    )
    pull.add_argument("name", help="org/repo or org/repo:QUANT")
    pull.set_defaults(func=_pull, log_level="info")  # the download's progress lines
    listing = sub.add_parser(
        "list", help="the models the Hugging Face cache holds, with their format and size"
    )
    listing.set_defaults(func=_list)
    return parser


# each command's settings classes: what its --config file and PROBSERVE_ variables may set
def _settings(command: str) -> tuple[type, ...]:
    from probserve.settings import SERVE_SETTINGS

    return {
        "serve": SERVE_SETTINGS,
        "generate": (GenerateFlags, EngineConfig),
        "export": (ExportFlags,),
    }.get(command, ())


def with_presets(
    parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str]
) -> list[str]:
    """`argv` with the presets of its command put after the command's name: `serve --config
    FILE`'s flags, then PROBSERVE_<FLAG> variables (flags.presets). A `--config` file of the
    cluster format (a `models:` list: the Ray cluster file that flag named before
    --cluster-config) is taken as --cluster-config, with a deprecation warning."""
    first = parser.parse_args(argv)
    command = getattr(first, "command", None)
    if command is None:
        return argv
    at = argv.index(command)
    values: dict[str, Any] = {}
    path = getattr(first, "config", None)
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise PresetError(f"cannot read the --config file {path}: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PresetError(f"the --config file {path} is not a mapping of flags to values")
        if isinstance(data.get("models"), list):
            logging.getLogger(__name__).warning(
                "--config %s is a Ray cluster file: that spelling is deprecated, use "
                "--cluster-config (--config now names a file of serve flags)",
                path,
            )
            values = {"cluster_config": path}
        else:
            values = data
    rest = argv[at + 1 :]
    if getattr(first, "model_tag", None):  # `serve MODEL`: the file's and variables' model yield
        rest = [*rest, "--model"]  # seen as given; never parsed (presets only reads the names)
    tokens = presets(_settings(command), rest, environ, values)
    return [*argv[: at + 1], *tokens, *argv[at + 1 :]]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = with_presets(parser, argv, os.environ)
    except PresetError as exc:
        print(f"probserve: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    from probserve.api.edge.server import ListenError
    from probserve.api.errors import APIError

    try:
        return int(args.func(args) or 0)
    except (ModelLoadError, APIError, EngineDead, UsageError, ListenError) as exc:
        print(f"probserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
