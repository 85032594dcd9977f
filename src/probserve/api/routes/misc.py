"""GET /health, GET /metrics, GET /v1/models, and the tokenizer endpoints lm-evaluation-harness
probes at the server root: GET /tokenizer_info, POST /tokenize, POST /detokenize."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from probserve.api.errors import ERRORS, bad_request
from probserve.api.off_loop import off_loop
from probserve.api.plans.chat import tool_format
from probserve.api.prompts import check_messages, check_text_size, render_chat
from probserve.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from probserve.api.server.lookup import server_state, serving_of
from probserve.api.server.metrics import CONTENT_TYPE
from probserve.api.server.on_demand import OnDemandModel
from probserve.api.server.served import ServedModel
from probserve.api.server.state import ServerState, Serving
from probserve.api.tools.ask import tool_ask
from probserve.api.tools.prompt import tool_prompt, tools_chars
from probserve.engine.info import EngineInfo

router = APIRouter()


def model_health(model: ServedModel, max_tokens_default: int) -> dict[str, object]:
    """One model's engine, read now: its status (and why, when not ok), counts and settings
    (with the budget of a request that sets none: `max_tokens_default`, the flag's value)."""
    engine = model.engine
    status, reason = model.health()
    body: dict[str, object] = {"status": status, **engine.stats().figures()}
    body["max_tokens_default"] = model.max_tokens_default(max_tokens_default)
    info = model.info  # None when a worker died before saying hello
    if info is not None:
        body.update(serving_facts(info))
        # what the fingerprint was made of (engine/fingerprint.py)
        fp = info.fingerprint
        body["numerics"] = dataclasses.asdict(fp) if fp is not None else None
    if reason is not None:
        body["reason"] = reason
    return body


def on_demand_health(entry: OnDemandModel, max_tokens_default: int) -> dict[str, object]:
    """A model on demand: its engine's figures while it is loaded, its state and last reason
    (a failed load's, an unload's) always."""
    if entry.served is not None and entry.state in ("loaded", "unloading"):
        body = model_health(entry.served, max_tokens_default)
    else:
        body = {"status": entry.state}
    body.update(state=entry.state, pinned=False, loads=entry.loads)
    if entry.reason is not None:
        body["reason"] = entry.reason
    return body


def every_model_health(st: ServerState) -> dict[str, dict[str, object]]:
    """Each model's health by its name: the pinned ones, then those on demand."""
    flag = st.config.limits.max_tokens_default
    models = {m.name: {**model_health(m, flag), "state": "loaded", "pinned": True}
              for m in st.pinned}  # fmt: skip
    if st.on_demand is not None:
        for name, entry in st.on_demand.entries.items():
            models[name] = on_demand_health(entry, flag)
    return models


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while every loaded model serves ("ok") or some do ("degraded"); 503 when none does
    (its engine has died, or one step has been running past --engine-stall-timeout): a load
    balancer must stop sending traffic. The first model's figures are also at the top level.
    A model on demand that is not loaded counts for neither (a server with no model loaded
    yet is "ok": a request loads one)."""
    st = server_state(request)
    models = every_model_health(st)
    loaded = [h for h in models.values() if h["state"] in ("loaded", "unloading")]
    statuses = [str(h["status"]) for h in loaded]
    first = models[st.default_name]
    if all(s == "ok" for s in statuses):
        status = "ok"
    elif "ok" in statuses:
        status = "degraded"
    else:
        status = str(first["status"])
    body = {**first, "status": status, "models": models}
    return JSONResponse(body, 200 if status in ("ok", "degraded") else 503)


@router.get("/metrics", responses=ERRORS)
async def metrics(request: Request) -> Response:
    """Prometheus text format, vLLM's metric names (behind --api-key unless --open-metrics)."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


def serving_facts(info: EngineInfo) -> dict[str, object]:
    """What runs how: the architecture, the runner, deterministic on/off, the weight formats,
    the fraction of the parameters held in blocks and whether their products are the block-sum
    ones (on /health and every /v1/models card)."""
    return {
        "architecture": info.architecture,
        "runner": info.runner,
        "device": info.device,
        "precision": info.precision,
        "deterministic": info.deterministic,
        "weights": info.weights,
        "weights_in_blocks": info.weights_in_blocks,
        "block_sums": info.block_sums,
        "products": info.products,
        "kernel_isa": info.kernel_isa,
        "speculative": info.speculative,
        "system_fingerprint": info.system_fingerprint,
        # a hybrid model's (Qwen3.5's) recurrent state a sequence holds beside its KV blocks
        "state_bytes_per_sequence": info.state_bytes_per_sequence or None,
        "prefix_caching_off": info.prefix_caching_off or None,  # why, where asked but off
        "routed_experts": (
            {"layers": list(info.moe_layers), "experts_per_token": info.experts_per_token}
            if info.moe_layers
            else None
        ),
    }


def _card(model: ServedModel, name: str, max_tokens_default: int) -> ModelCard:
    replicas = model.engine.stats().replicas
    info = model.info
    return ModelCard(
        id=name,
        root=model.root,
        max_model_len=model.context_length,
        max_tokens_default=model.max_tokens_default(max_tokens_default),
        status=model.health()[0],
        replicas=None if replicas is None else int(replicas),
        **(serving_facts(info) if info is not None else {}),
    )


def _on_demand_card(entry: OnDemandModel, max_tokens_default: int) -> ModelCard:
    if entry.served is not None and entry.state in ("loaded", "unloading"):
        card = _card(entry.served, entry.name, max_tokens_default)
    else:
        card = ModelCard(id=entry.name, root=entry.spec, status=entry.state)
    return card.model_copy(update={"state": entry.state, "pinned": False, "reason": entry.reason})


def every_card(st: ServerState) -> list[ModelCard]:
    """Every name of every pinned model (an alias's `root` is its model's own name), then each
    model on demand, loaded or not."""
    flag = st.config.limits.max_tokens_default
    cards = [_card(m, n, flag) for m in st.pinned for n in m.names]
    if st.on_demand is not None:
        cards += [_on_demand_card(e, flag) for e in st.on_demand.entries.values()]
    return cards


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=every_card(server_state(request)))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def get_model(model_id: str, request: Request) -> ModelCard:
    st = server_state(request)
    if st.on_demand is not None and model_id in st.on_demand.entries:
        entry = st.on_demand.entries[model_id]
        return _on_demand_card(entry, st.config.limits.max_tokens_default)
    return _card(*st.model(model_id), st.config.limits.max_tokens_default)


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS)
async def tokenizer_info(request: Request, model: str | None = Query(None)) -> TokenizerInfo:
    st = server_state(request).serving(model)
    tok = st.record.tokenizer
    return TokenizerInfo(
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        chat_template=st.record.chat_template,
        model_max_length=st.model.context_length,
        vocab_size=st.record.vocab_size,
    )


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(
    body: TokenizeRequest, st: Annotated[Serving, Depends(serving_of(TokenizeRequest))]
) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        fmt = tool_format(st)
        functions = [t.function for t in body.tools] if body.tools else None
        tools = tool_ask(functions, None, None, fmt)
        dicts = check_messages(st.config.limits, body.messages, tools_chars(tools))
        shown = tool_prompt(dicts, tools, fmt)
        ids = await off_loop(
            render_chat, st.record, shown.messages, body.add_generation_prompt,
            shown.template_kwargs,
        )  # fmt: skip
    else:
        prompt = body.prompt or ""
        check_text_size(st.config.limits, [prompt])
        encoded = await off_loop(
            lambda: st.record.tokenizer(prompt, add_special_tokens=body.add_special_tokens)
        )
        ids = list(encoded.input_ids)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=st.model.context_length)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(
    body: DetokenizeRequest, st: Annotated[Serving, Depends(serving_of(DetokenizeRequest))]
) -> DetokenizeResponse:
    bad = next((t for t in body.tokens if t >= st.record.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary", "tokens")
    return DetokenizeResponse(prompt=await off_loop(st.table.decode, body.tokens))
