"""/v1/models' cards and the tokenizer routes' shapes (/tokenize, /detokenize,
/tokenizer_info)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.chat import ChatMessage, ChatTool
from probserve.api.protocol.common import (
    MAX_FEW,
    MAX_IDS,
    MAX_ITEMS,
    Int,
    RequestModel,
    Text,
    bounded,
    now,
)


class RoutedShape(BaseModel):
    """A mixture of experts' routing as return_routed_experts gives it: the MoE layers (the
    rows of each token's arrays) and the experts a token goes to (the columns)."""

    layers: list[int]
    experts_per_token: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "probserve"
    root: str | None = None  # the model this name serves (its first name)
    max_model_len: int | None = None
    # what a request that sets no budget generates at most (--max-tokens-default; null: the context)
    max_tokens_default: int | None = None
    status: str = "ok"  # the model's engine: ok, stuck, dead or restarting (see /health)
    # where the model stands: loaded, or (served on demand) loading, unloaded, unloading, failed
    state: str = "loaded"
    pinned: bool = True  # given with --model: never unloaded (else served on demand)
    reason: str | None = None  # why it failed to load, or why it was last unloaded
    replicas: int | None = None  # on Ray Serve: the model's replicas answering (see /health)
    # what runs how (see /health): absent before the engine has said
    architecture: str | None = None
    runner: str | None = None
    device: str | None = None  # cpu, cuda (the GPU path), interpreted
    precision: str | None = None  # the GPU path's weights: exact or bf16
    deterministic: bool | None = None
    weights: str | None = None
    weights_in_blocks: float | None = None
    block_sums: bool | None = None
    products: str | None = None
    kernel_isa: str | None = None
    routed_experts: RoutedShape | None = None  # a mixture of experts: what routing holds
    speculative: str | None = None  # requests' default speculative decoding ("off", "ngram")
    system_fingerprint: str | None = None  # the numerics fingerprint answers carry


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ModelLoadRequest(RequestModel):
    """POST /models/load and /models/unload (llama-server's router): the model, by its name."""

    model: Text


class ModelLoadResponse(BaseModel):
    success: bool = True
    model: str
    state: str  # loaded, unloaded (see /v1/models)
    pinned: bool = False


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], bounded(MAX_ITEMS)] | None = None
    tools: Annotated[list[ChatTool], bounded(MAX_FEW)] | None = None  # with messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]] = bounded(MAX_IDS)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
