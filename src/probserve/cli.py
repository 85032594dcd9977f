"""The `probserve` command: `generate` (one prompt, printed with its logprobs) and `serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys

from probserve.engine import (
    EngineConfig,
    EngineDead,
    EngineRequest,
    LogprobsMode,
    LogprobsSpec,
    SamplingParams,
)
from probserve.flags import add_args, from_args
from probserve.models import DEFAULT_MODEL, ModelLoadError, load_model


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="smollm2-135m-instruct (embedded, default), a local HF directory, a .gguf file, "
        "or a hub id such as org/name",
    )


def _fmt(lp: float) -> str:
    return "-inf" if math.isinf(lp) else f"{lp:.4f}"


async def _generate(args: argparse.Namespace) -> int:
    from probserve.api.prompts import build_completion_prompts
    from probserve.api.tokens import TokenTable, token_text
    from probserve.engine import AsyncEngine, EngineCore

    loaded = load_model(args.model)
    table = TokenTable(loaded.tokenizer, loaded.vocab_size)
    engine = AsyncEngine(EngineCore(loaded, from_args(EngineConfig, args)))
    (prompt,) = build_completion_prompts(loaded, table, [args.prompt], engine.info.max_context)
    prompt_ids = tuple(prompt.ids)
    request = EngineRequest(
        request_id=AsyncEngine.new_request_id("cli"),
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
        ),
        logprobs=LogprobsSpec(top_k=args.logprobs, mode=LogprobsMode(args.logprobs_mode)),
    )
    try:
        outputs = await engine.generate(request)
    finally:
        engine.stop()
    ids = [t for out in outputs for t in out.new_token_ids]
    out_text = table.decode([t for t in ids if t not in loaded.eos_token_ids])
    print(args.prompt + out_text)
    print()
    print(f"{'token':<20} {'logprob':>10}  top-{args.logprobs}")
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

    out = save_hf_directory(load_model(args.model), args.directory)
    print(f"wrote {out}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        from probserve.cluster.app import run_cluster

        if getattr(args, "chat_template", None):
            raise ModelLoadError("--chat-template is not available with --ray")

        return run_cluster(args)
    from probserve.serving import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    from probserve.api.limits import Limits

    parser = argparse.ArgumentParser(prog="probserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print each token's logprobs")
    _add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--logprobs", type=int, default=5, help="alternatives shown per token")
    gen.add_argument("--logprobs-mode", choices=["raw", "processed", "both"], default="raw")
    add_args(gen, EngineConfig)
    gen.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    export = sub.add_parser(
        "export", help="write the model's float32 weights and tokenizer as a plain HF directory"
    )
    _add_model_args(export)
    export.add_argument("directory")
    export.set_defaults(func=_export)

    serve = sub.add_parser("serve", help="serve the OpenAI API")
    serve.add_argument(
        "--model",
        action="append",
        default=None,
        help="a model to serve (repeat for several, each in its own engine worker): "
        "smollm2-135m-instruct (embedded, the default), a local HF directory, a .gguf file, "
        "or a hub id such as org/name",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name clients use for the model of the same position (it also answers to its own)",
    )
    serve.add_argument(
        "--chat-template",
        action="append",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file for the model of the same position (for a model file "
        "that ships none, or to replace its own); clients can never send one",
    )
    serve.add_argument(
        "--worker-restarts",
        type=int,
        default=3,
        help="restarts of a model's dead engine worker in any 10 minutes before it is given up "
        "(the server exits non-zero once no model can serve)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (or set PROBSERVE_API_KEY)",
    )
    serve.add_argument("--api-key-file", default=None, help="a file with one API key per line")
    serve.add_argument(
        "--open-metrics", action="store_true", help="serve /metrics without an API key"
    )
    add_args(serve, Limits)
    serve.add_argument("--max-logprobs", type=int, default=20)
    serve.add_argument("--max-top-logprobs", type=int, default=20, help="chat top_logprobs cap")
    serve.add_argument("--logprobs-mode", choices=["raw", "processed", "both"], default="raw")
    add_args(serve, EngineConfig)
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve on a Ray Serve cluster: replicas of each model's engine, prefix-aware "
        "routing, failover (pip install 'probserve[ray]'; docs/scale-out.md)",
    )
    serve.add_argument("--config", default=None, help="--ray: the cluster configuration file")
    serve.add_argument("--replicas", type=int, default=1, help="--ray without --config: per model")
    serve.add_argument(
        "--ray-address", default=None, help="--ray: the Ray cluster to join (default: start one)"
    )
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
