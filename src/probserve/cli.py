"""The `probserve` command: `generate` (one prompt, printed with its logprobs) and `serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from dataclasses import dataclass

from probserve.engine import (
    EngineConfig,
    EngineDead,
    EngineRequest,
    LogprobsMode,
    LogprobsSpec,
    SamplingParams,
)
from probserve.flags import add_args, from_args, setting
from probserve.models import DEFAULT_MODEL, MODEL_HELP, ModelLoadError, load_model


@dataclass(frozen=True)
class GenerateFlags:
    """`probserve generate`'s flags (the engine's too: EngineConfig)."""

    prompt: str = setting("", "the prompt to complete", positional=True)
    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
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


def _fmt(lp: float) -> str:
    return "-inf" if math.isinf(lp) else f"{lp:.4f}"


async def _generate(args: argparse.Namespace) -> int:
    from probserve.api.prompts import build_completion_prompts
    from probserve.api.tokens import TokenTable, token_text
    from probserve.engine import AsyncEngine

    flags, config = from_args(GenerateFlags, args), from_args(EngineConfig, args)
    loaded = load_model(flags.model, config.weights_to_load())
    table = TokenTable(loaded.tokenizer, loaded.vocab_size)
    engine = AsyncEngine.over(loaded, config)
    (prompt,) = build_completion_prompts(loaded, table, [flags.prompt], engine.info.max_context)
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


def _serve(args: argparse.Namespace) -> int:
    from probserve.serving import ServeFlags, run_server

    flags = from_args(ServeFlags, args)
    if flags.ray:
        from probserve.cluster.app import run_cluster

        if flags.chat_template:
            raise ModelLoadError("--chat-template is not available with --ray")
        return run_cluster(args)
    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    from probserve.serving import add_serve_args

    parser = argparse.ArgumentParser(prog="probserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print each token's logprobs")
    add_args(gen, GenerateFlags)
    add_args(gen, EngineConfig)
    gen.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    export = sub.add_parser(
        "export", help="write the model's float32 weights and tokenizer as a plain HF directory"
    )
    add_args(export, ExportFlags)
    export.set_defaults(func=_export)

    serve = sub.add_parser("serve", help="serve the OpenAI API")
    add_serve_args(serve)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "warning")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from probserve.api.errors import APIError

    try:
        return int(args.func(args) or 0)
    except (ModelLoadError, APIError, EngineDead) as exc:
        print(f"probserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
