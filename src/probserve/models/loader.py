"""Load a model from its source (models/sources.py) with transformers: float32 weights, or a
GGUF file's native blocks beside a weightless skeleton; a GGUF file's metadata directory
written once (models/cache.py); the tokenizer alone for the API process."""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from probserve.models.families import GGUF_UNREADABLE, TYPES
from probserve.models.gguf_once import without_fields
from probserve.models.sources import (
    ModelLoadError,
    ModelSource,
    resolve_model,
)
from probserve.models.sources import embedded_gguf_path as embedded_gguf_path

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """Everything the engine and the API need from a loaded model."""

    # a transformers PreTrainedModel (causal LM), in eval mode, float32; with `weights`, its
    # skeleton on the meta device (sizes, constants, RoPE), the tensors being in `weights`
    model: Any
    tokenizer: Any  # a transformers tokenizer
    name: str
    eos_token_ids: frozenset[int]
    context_length: int
    vocab_size: int
    chat_template: str | None = None
    source: ModelSource | None = field(default=None, repr=False)
    # native weights (a GGUF file's blocks, models/gguf_blocks.py) by parameter name, or None
    weights: dict[str, Any] | None = field(default=None, repr=False)
    weights_format: str = "float32"  # what the weights are held as: float32, or "Q4_1+Q8_0"
    weights_in_blocks: float = 0.0  # the fraction of the parameters held in GGUF blocks


_LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError)


def _first(exc: BaseException) -> str:
    """The first line of an error's message (transformers' run to many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _context_length(config: Any, tokenizer: Any) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**7:
        return limit
    return 2048


Weights = Literal["native", "float32"]


def load_source(source: ModelSource, weights: Weights = "float32") -> LoadedModel:
    """Load a resolved source: tokenizer, limits, and the weights in float32 and eval mode, or
    with `weights="native"` a GGUF file's quantized blocks as the file holds them (where the
    file has blocks the kernels multiply, the model runs on the paged forward and the kernels
    build here; otherwise float32, with a warning saying why)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, **kwargs)
        native = _native(source, kwargs) if weights == "native" else None
        if native is not None:
            model, tensors, held, share = native
        else:
            where, kwargs = float32_weights(source, kwargs)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
            tensors, held, share = None, "float32", 0.0
    except _LOAD_ERRORS as exc:
        raise _load_error(source, exc) from exc
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=source.served_name or source.name_or_path,
        eos_token_ids=_eos_ids(model, tokenizer),
        context_length=_context_length(model.config, tokenizer),
        vocab_size=int(
            model.config.vocab_size if tensors else model.get_output_embeddings().weight.shape[0]
        ),
        chat_template=getattr(tokenizer, "chat_template", None),
        source=source,
        weights=tensors,
        weights_format=held,
        weights_in_blocks=share,
    )


def _load_error(source: ModelSource, exc: BaseException) -> ModelLoadError:
    why = _first(exc)
    if (source.gguf_file or source.blocks_file) and "reshape" in why:  # past the file's end
        why = f"the file is truncated or damaged ({why})"
    return ModelLoadError(f"cannot load model {source.label}: {why}")


def _native(
    source: ModelSource, kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any], str, float] | None:
    """(skeleton, tensors by name, formats, the share of the parameters held in blocks) for a
    quantized GGUF source the quantized forward serves; None (float32 is loaded instead) for any
    other, with a warning where it is a GGUF file that cannot run natively."""
    from transformers import AutoConfig, GenerationConfig

    from probserve.kernels.build import KernelBuildError, build
    from probserve.models import llama
    from probserve.models.family import Unsupported
    from probserve.models.gguf_blocks import block_formats, load_weights
    from probserve.models.gguf_hybrid import TILED
    from probserve.models.skeleton import Skeleton

    path = source.quantized_file
    if not path:
        return None
    with without_fields(GGUF_UNREADABLE):
        config = AutoConfig.from_pretrained(source.name_or_path, **kwargs)
    if kwargs.get("gguf_file"):  # the file itself (no metadata directory): complete it here
        config = _gguf_config(config, Path(path))
    if config.model_type in TILED and config.linear_num_value_heads != config.linear_num_key_heads:
        config.gguf_value_heads = "tiled"  # out_proj keeps the file's column order (gguf_hybrid)
    generation = None
    with contextlib.suppress(OSError):  # none saved: the config's own EOS ids stay
        generation = GenerationConfig.from_pretrained(source.name_or_path, **kwargs)
    model = None
    try:
        model = Skeleton(config, generation)  # transformers' modeling code is never imported
        why = llama.deterministic_blocker(model)
    except Unsupported as exc:
        kind = TYPES.get(config.model_type)
        if kind is not None and kind.paged_only:  # (no float32 runner serves it either)
            raise ModelLoadError(f"{source.label} cannot be served: {exc}") from exc
        why = f"{config.model_type}: {exc}"
    if why is None:
        try:
            build()
        except KernelBuildError as exc:
            why = str(exc)
    if why or model is None:
        log.warning("native weights are off for this model (%s): loading float32", why)
        return None
    weights = load_weights(path, model)
    formats = "+".join(block_formats(weights))
    if not formats and _unread_by_transformers(config, Path(path)) is None:
        return None  # no blocks the kernels read: the float32 model is as small
    from probserve.models.gguf_blocks import blocks_share

    share, how = blocks_share(weights)
    log.info(
        "native weights from %s: %.0f%% of the parameters in blocks (%s)", path, 100 * share, how
    )
    return model, weights, formats or "float32", share


def prepared_source(spec: str | None) -> ModelSource:
    """Resolve a `--model` spec; a GGUF file becomes its metadata directory (models/cache.py:
    configuration and tokenizer, no weights), which names the file its blocks are read from."""
    from probserve.models.cache import converted_dir, written

    source = resolve_model(spec)
    if not source.gguf_file:
        return source
    gguf = Path(source.name_or_path) / source.gguf_file
    target = written(
        converted_dir(gguf), lambda out: write_metadata(source, out), f"the metadata of {gguf.name}"
    )
    if target is None:
        log.warning("reading %s directly at every start", gguf)
        return source
    return ModelSource(str(target), None, source.served_name, blocks_file=str(gguf))


def write_metadata(source: ModelSource, out: Path) -> None:
    """A GGUF source's configuration, generation configuration, tokenizer and chat template as
    Hugging Face files in `out`, read from the file's metadata without its weights (the
    generation configuration is the one transformers derives when it loads the file)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from probserve.models.gguf_hybrid import own_config

    kwargs = {"gguf_file": source.gguf_file}
    gguf = Path(source.name_or_path) / str(source.gguf_file)
    try:
        own = own_config(str(gguf))  # an architecture transformers does not read (Qwen3-Next)
        with without_fields(GGUF_UNREADABLE):
            config = own or AutoConfig.from_pretrained(source.name_or_path, **kwargs)
            kind = {"tokenizer_type": config.model_type} if own is not None else {}
            tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, **kwargs, **kind)
    except _LOAD_ERRORS as exc:
        raise _load_error(source, exc) from exc
    config = _gguf_config(config, gguf)
    config.dtype = torch.float32
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _gguf_config(config: Any, gguf: Path) -> Any:
    """What transformers' configuration of a GGUF file leaves out, completed from the file's
    metadata (and tensors) where its type's entry says how (models/families.py: a Qwen3-MoE
    file's experts' width, a Mixtral file read as a dense Llama, gpt-oss's head, width, window
    and RoPE, Gemma 4's layers). Other configurations come back as they are."""
    kind = TYPES.get(getattr(config, "model_type", None) or "")
    if kind is None or kind.gguf is None:
        return config
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    fields, tensors = reader.fields, {t.name: t for t in reader.tensors}

    def read(key: str) -> Any:
        field = fields.get(key)
        return tensors.get(key) if field is None else field.contents()

    return kind.gguf(config, read)


def _unread_by_transformers(config: Any, gguf: Path) -> str | None:
    """What kind of file of its type transformers' GGUF loader misreads (Mixtral: a dense
    Llama; gpt-oss: not at all; experts' gate and up in one tensor: left random), or None."""
    kind = TYPES.get(config.model_type)
    return None if kind is None or kind.unread is None else kind.unread(gguf)


def float32_weights(source: ModelSource, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where transformers loads `source`'s float32 weights from (and its keyword arguments): a
    GGUF file's metadata directory has none, so its float32 copy is written once beside it
    (loaded from the file, one model in memory, saved as it is) and read from there; where that
    cannot be written, the GGUF file itself."""
    if not source.blocks_file:
        return source.name_or_path, kwargs
    from probserve.models.cache import float32_dir, written

    gguf = Path(source.blocks_file)

    def write(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(source.name_or_path)  # completed (_gguf_config)
        unread = _unread_by_transformers(config, gguf)
        if unread:
            raise ModelLoadError(
                f"{gguf.name} is a {unread} file transformers' GGUF loader does not read: it is "
                "served in its blocks only (--weights native with --deterministic)"
            )
        kind = TYPES.get(config.model_type)
        extra = {"config": config} if kind is not None and kind.passes_config else {}
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **extra
        )
        _save_weights(model, out)
        for item in Path(source.name_or_path).iterdir():  # the metadata: a whole HF directory
            if item.is_file() and not (out / item.name).exists():
                shutil.copy2(item, out / item.name)

    target = written(float32_dir(gguf), write, f"float32 weights of {gguf.name}")
    if target is None:
        return str(gguf.parent), {"gguf_file": gguf.name}
    return str(target), {}


def float32_directory(spec: str | None) -> str:
    """A plain Hugging Face directory of `spec` with float32 weights (what another server or
    lm-evaluation-harness's `hf` backend reads)."""
    from probserve.models.gguf_once import parsed_once

    with parsed_once():
        source = prepared_source(spec)
        where, kwargs = float32_weights(source, {})
    if kwargs or source.gguf_file:  # the cache could not be written: the GGUF file alone
        raise ModelLoadError(f"no float32 directory of {spec} could be written")
    return where


def load_model(spec: str | None = None, weights: Weights = "float32") -> LoadedModel:
    """Resolve and load a model; raises ModelLoadError with a one-line message on failure."""
    return loaded_source(spec, weights)[1]


def loaded_source(
    spec: str | None, weights: Weights = "float32"
) -> tuple[ModelSource, LoadedModel]:
    """`spec` resolved (a GGUF file: its metadata directory, written at its first start) and
    loaded, the file's header parsed once for both (models/gguf_once.py)."""
    from probserve.models.gguf_once import parsed_once

    with parsed_once():
        source = prepared_source(spec)
        log.info("loading model %s (gguf=%s)", source.name_or_path, source.gguf_file)
        return source, load_source(source, weights)


def tokenizer_class(tokenizer: Any) -> str:
    """`tokenizer`'s class as "module:qualname" where `load_tokenizer` can load it by name (one
    of transformers' own), else ""."""
    cls = type(tokenizer)
    own = cls.__module__.startswith("transformers.")
    return f"{cls.__module__}:{cls.__qualname__}" if own else ""


def load_tokenizer(source: ModelSource, cls: str = "") -> Any:
    """The tokenizer alone (what an API server process needs beside an engine worker): of the
    class `cls` ("module:qualname", from `tokenizer_class`) where given, as AutoTokenizer chose
    it for the same files elsewhere. AutoTokenizer itself imports transformers' configuration
    code, which loads torch (~200 MB) into a process that never runs a model."""
    import importlib

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        if cls and not source.gguf_file:
            module, _, name = cls.partition(":")
            if module.startswith("transformers."):
                chosen = getattr(importlib.import_module(module), name)
                return chosen.from_pretrained(source.name_or_path, **kwargs)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.name_or_path, **kwargs)
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {source.label}: {_first(exc)}") from exc


def _save_weights(model: Any, out: Path) -> None:
    """`model`'s weights and configuration, as they are (no second model is built). A model
    transformers loaded from a GGUF file carries the file's quantizer, which refuses to save: the
    weights are float32 already, so it is set aside for the save, and so is its configuration's
    quantization marker."""
    import copy

    config, quantizer = model.config, getattr(model, "hf_quantizer", None)
    saved = copy.deepcopy(config)
    if hasattr(saved, "quantization_config"):
        del saved.quantization_config
    model.config, model.hf_quantizer = saved, None
    try:
        model.save_pretrained(out)
    finally:
        model.config, model.hf_quantizer = config, quantizer


def save_hf_directory(loaded: LoadedModel, path: str | Path) -> Path:
    """Write the loaded weights (float32) and tokenizer as a plain Hugging Face directory, e.g.
    to give lm-evaluation-harness's `hf` backend the exact weights probserve serves. A GGUF
    source's quantization marker is dropped: the weights are already dequantised."""
    if loaded.weights is not None:
        raise ModelLoadError("a model loaded with native weights has no float32 weights to save")
    out = Path(path)
    _save_weights(loaded.model, out)
    loaded.tokenizer.save_pretrained(out)
    return out
