"""Models by name: `ORG/REPO[:QUANT]` on the Hugging Face hub, pulled with huggingface_hub into
its cache (`HF_HOME`; `HF_HUB_OFFLINE`, `HF_TOKEN` and `HF_ENDPOINT` respected), as llama.cpp's
`-hf org/repo:Q4_K_M` and `ollama pull` do.

A repository with GGUF files: the quantization asked (a file whose name holds the tag, any
case; without a tag Q4_K_M as llama.cpp, or the repository's only one), downloaded with a
progress bar and resumed where an earlier download stopped; a split GGUF (`-00001-of-00003`)
is every part, joined once into one file in probserve's cache. A repository of safetensors:
its snapshot (weights, config, tokenizer), served through the float32 path. Offline (or when
the hub cannot be reached) the cache answers alone. `cached_models` lists what the cache holds.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from probserve.cache_dir import cache_root
from probserve.models.errors import ModelLoadError
from probserve.progress import Stage

log = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice where a name has no tag
_NAME = re.compile(r"^([A-Za-z0-9][\w.-]{0,95})/([\w.-]{1,96})(?::([\w.-]{1,64}))?$")
# a quantization in a file name: Q4_K_M, IQ3_XXS, Q8_0, TQ1_0, BF16, F16, F32, MXFP4(_MOE)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# what a safetensors snapshot needs: weights, configuration, tokenizer, template
_SNAPSHOT = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class HubName:
    """`ORG/REPO[:QUANT]`."""

    repo: str
    quant: str | None = None

    @classmethod
    def parse(cls, spec: str) -> HubName | None:
        """The name, or None where `spec` is not one (a path, a file)."""
        found = _NAME.match(spec)
        if found is None or spec.endswith(".gguf"):
            return None
        return cls(f"{found[1]}/{found[2]}", found[3])

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass(frozen=True)
class RepoFile:
    path: str  # in the repository
    size: int
    cached: Path | None = None  # where the cache holds it (a listing read from the cache)


@dataclass(frozen=True)
class Pulled:
    """Where a pulled model lies: a GGUF file, or a snapshot directory (safetensors)."""

    path: Path
    format: str  # "GGUF Q4_K_M", "safetensors"


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name (or folder) says, upper case; with the short
    capital prefix some publishers put before it (unsloth's dynamic "UD-Q4_K_XL")."""
    name = _SPLIT.sub(".gguf", filename)
    found = list(_QUANT.finditer(name))
    if not found:
        return None
    last = found[-1]
    prefix = re.search(r"(?<![A-Za-z0-9])([A-Z]{1,3})[-_]$", name[: last.start()])
    tag = last[1].upper()
    return f"{prefix[1]}-{tag}" if prefix and not _QUANT.fullmatch(prefix[1]) else tag


def gguf_groups(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The repository's GGUF models by quantization: one file, or a split model's parts in
    order (projector files of vision models left out). Two models of one quantization (two
    base names) are told apart by their file names."""
    by_base: dict[str, list[RepoFile]] = {}
    for f in files:
        name = f.path.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower():
            continue
        by_base.setdefault(_SPLIT.sub("", f.path), []).append(f)
    groups: dict[str, list[RepoFile]] = {}
    for base, parts in sorted(by_base.items()):
        label = quant_of(parts[0].path) or base.rsplit("/", 1)[-1].removesuffix(".gguf").upper()
        if label in groups:
            label = base.rsplit("/", 1)[-1].removesuffix(".gguf")
        groups[label] = sorted(parts, key=lambda f: f.path)
    return groups


def _whole(label: str, parts: list[RepoFile]) -> list[RepoFile]:
    """A split model's parts: all of them (00001..N of N), or a one-line error."""
    if len(parts) == 1 and not _SPLIT.search(parts[0].path):
        return parts
    found = [_SPLIT.search(p.path) for p in parts]
    total = int(found[0][2]) if found[0] else 0
    numbers = [int(m[1]) for m in found if m]
    if total == 0 or numbers != list(range(1, total + 1)):
        raise ModelLoadError(
            f"the {label} model is split into {total or '?'} parts and {len(numbers)} are there"
        )
    return parts


def _choose(name: HubName, groups: dict[str, list[RepoFile]]) -> tuple[str, list[RepoFile]]:
    there = ", ".join(sorted(groups))
    if name.quant is not None:
        asked = name.quant.upper()
        if asked in {g.upper() for g in groups}:
            label = next(g for g in groups if g.upper() == asked)
            return label, _whole(label, groups[label])
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(asked)}(?![A-Za-z0-9])", re.IGNORECASE)
        named = [g for g, fs in groups.items() if tag.search(fs[0].path)]
        if len(named) == 1:
            return named[0], _whole(named[0], groups[named[0]])
        raise ModelLoadError(f"{name.repo} has no {name.quant} GGUF file (it has: {there})")
    if DEFAULT_QUANT in groups:
        return DEFAULT_QUANT, _whole(DEFAULT_QUANT, groups[DEFAULT_QUANT])
    if len(groups) == 1:
        label, parts = next(iter(groups.items()))
        return label, _whole(label, parts)
    raise ModelLoadError(
        f"{name.repo} has no {DEFAULT_QUANT} file: name one of its quantizations, "
        f"{name.repo}:QUANT (it has: {there})"
    )


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hub_files(repo: str) -> list[RepoFile]:
    from huggingface_hub import HfApi

    info = HfApi(endpoint=_endpoint()).model_info(repo, files_metadata=True)
    return [RepoFile(s.rfilename, int(s.size or 0)) for s in info.siblings or ()]


def _repo_files(r: Any) -> list[RepoFile]:
    """Every file of every cached revision of repository `r` (scan_cache_dir's), each with
    where it lies (a path in several revisions: the newest's)."""
    files: dict[str, RepoFile] = {}
    for rev in sorted(r.revisions, key=lambda v: v.last_modified, reverse=True):
        for f in rev.files:
            path = str(f.file_path.relative_to(rev.snapshot_path))
            files.setdefault(path, RepoFile(path, f.size_on_disk, f.file_path))
    return list(files.values())


def _cached_repos() -> list[Any]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    return [r for r in cache.repos if r.repo_type == "model" and r.revisions]


def _cached_files(repo: str) -> list[RepoFile] | None:
    """What the cache holds of `repo` (None: nothing)."""
    found = [r for r in _cached_repos() if r.repo_id == repo]
    return _repo_files(found[0]) if found else None


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the hub could not be reached (or may not be: offline mode)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return False  # the hub answered (a 429, a 5xx): it was reached
    if isinstance(exc, OfflineModeIsEnabled | LocalEntryNotFoundError | OSError):
        return True  # OSError: a refused connection, an unknown host, a socket's timeout
    # the HTTP client's transport errors (huggingface_hub's httpx, whichever build it uses)
    if any(k.__name__ == "TransportError" for k in type(exc).__mro__):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and _unreachable(cause)


def _refusal(name: HubName, exc: Exception) -> ModelLoadError:
    """What the hub's refusal of `name` means, in one line."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{name.repo} is gated: accept its terms on the hub and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"unknown repository {name.repo} on the hub (a private one needs HF_TOKEN)"
        )
    if _unreachable(exc):
        return ModelLoadError(
            f"no network: the hub ({_endpoint() or 'huggingface.co'}) cannot be reached and "
            f"{name.repo} is not in the Hugging Face cache"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"the hub refused {name}: {first}")


def _listing(name: HubName) -> list[RepoFile]:
    """The repository's files: the hub's, or (offline, or the hub unreachable) the cache's,
    each with where the cache holds it."""
    if not _offline():
        try:
            return _hub_files(name.repo)
        except Exception as exc:
            cached = _cached_files(name.repo) if _unreachable(exc) else None
            if cached is None:
                raise _refusal(name, exc) from None
            return cached
    cached = _cached_files(name.repo)
    if cached is None:
        raise ModelLoadError(
            f"offline mode (HF_HUB_OFFLINE): {name.repo} is not in the Hugging Face cache; "
            f"pull it with network first (probserve pull {name})"
        )
    return cached


class LoggedProgress(tqdm):
    """A download's progress as log lines (probserve.progress.Stage: a line as it begins,
    progress lines past a few seconds, one when done), where stderr is no terminal for
    huggingface_hub's bar (a server's log, a pipe). A tqdm that draws nothing itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        super().__init__(*args, **{**kwargs, "disable": True})
        desc = str(kwargs.get("desc") or "")
        total = float(kwargs.get("total") or 0)
        what = f"downloading {desc.rsplit('/', 1)[-1]}"
        self.stage = Stage(log, what, "kept in the Hugging Face cache", total / 1e6, "MB")
        self.stage.__enter__()
        self.stage.advance(float(kwargs.get("initial") or 0) / 1e6)
        self.ended = False

    def update(self, n: float | None = 1) -> bool | None:
        self.stage.advance(float(n or 0) / 1e6)
        return None

    def close(self) -> None:
        if not getattr(self, "ended", True):
            self.ended = True
            self.stage.__exit__(None, None, None)
        super().close()


def _bars() -> type[LoggedProgress] | None:
    """huggingface_hub's own bars on a terminal, log lines elsewhere."""
    return None if sys.stderr.isatty() else LoggedProgress


def _download(repo: str, f: RepoFile) -> Path:
    """One file into the cache (with progress; an interrupted download resumes), or the
    cached one where the listing came from the cache."""
    if f.cached is not None:
        return f.cached
    from huggingface_hub import hf_hub_download

    bars: Any = _bars()
    return Path(hf_hub_download(repo, f.path, endpoint=_endpoint(), tqdm_class=bars))


def _weights(files: list[RepoFile]) -> str | None:
    """A transformers repository's weight files: "*.safetensors", else "*.bin" (None: none).
    Mistral's consolidated copies are not transformers' (left out)."""
    names = [f.path for f in files if not f.path.rsplit("/", 1)[-1].startswith("consolidated")]
    if any(n.endswith(".safetensors") for n in names):
        return "*.safetensors"
    if any(n.endswith(".bin") and "pytorch_model" in n for n in names):
        return "*.bin"
    return None


def _cached(repo: str, files: list[RepoFile]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return all(isinstance(try_to_load_from_cache(repo, f.path), str) for f in files)


def pull(name: HubName) -> Pulled:
    """The model `name` names, in the cache (downloaded where it is not)."""
    try:
        return _pull(name)
    except ModelLoadError:
        raise
    except Exception as exc:  # the hub's (or the network's) refusal partway: one line
        raise _refusal(name, exc) from None


def _pull(name: HubName) -> Pulled:
    files = _listing(name)
    groups = gguf_groups(files)
    if groups:
        quant, chosen = _choose(name, groups)
        if any(f.cached is None for f in chosen) and not _cached(name.repo, chosen):
            size = sum(f.size for f in chosen) / 2**30
            log.warning("pulling %s: %s (%s, %.2f GiB)", name, chosen[0].path, quant, size)
        parts = [_download(name.repo, f) for f in chosen]
        path = parts[0] if len(parts) == 1 else join_split(parts, name.repo, quant)
        return Pulled(path, f"GGUF {quant}")
    weights = _weights(files)
    if weights is None:
        raise ModelLoadError(f"{name.repo} holds neither GGUF files nor transformers weights")
    kind = weights.removeprefix("*.")
    if name.quant is not None:
        raise ModelLoadError(f"{name.repo} holds {kind} weights, not GGUF files: leave out "
                             f":{name.quant}")  # fmt: skip
    log.warning("pulling %s: %s weights, served through the float32 path", name.repo, kind)
    config = next((f for f in files if f.path == "config.json"), None)
    if config is not None and config.cached is not None:  # the cache's snapshot
        return Pulled(config.cached.parent, kind)
    from huggingface_hub import snapshot_download

    snap = snapshot_download(
        name.repo, allow_patterns=[*_SNAPSHOT, weights], ignore_patterns=["consolidated*"],
        endpoint=_endpoint(),
    )  # fmt: skip
    return Pulled(Path(snap), kind)


def join_split(parts: list[Path], repo: str, quant: str) -> Path:
    """A split GGUF's parts as one file (once; kept in probserve's cache, named by the parts'
    names and sizes): the first part's metadata without the split keys, every part's tensors
    in order."""
    import gguf

    key = "-".join(f"{p.name}:{p.stat().st_size}" for p in parts)
    out = cache_root() / "joined" / repo.replace("/", "--") / f"{quant}-{_digest(key)}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    readers = [gguf.GGUFReader(str(p)) for p in parts]
    first = readers[0]
    arch = first.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ModelLoadError(f"{parts[0]} has no general.architecture: not a model's first part")
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch=str(arch.contents()))
    align = first.get_field(gguf.Keys.General.ALIGNMENT)
    if align is not None:  # its tensors' offsets are aligned as the file says (the key copied)
        writer.data_alignment = int(align.contents())
    for field in first.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith(
            ("GGUF.", "split.")
        ):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    tensors = [t for r in readers for t in r.tensors]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for reader in readers:
        for t in reader.tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(out)
    return out


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CachedModel:
    name: str  # what `serve` takes: org/repo:QUANT, or org/repo
    format: str
    size: int  # bytes on disk
    path: Path


def cached_models() -> list[CachedModel]:
    """What the Hugging Face cache holds that probserve can serve: each GGUF quantization of
    each repository (whole: a split model with every part), and each repository of
    transformers weights."""
    out: list[CachedModel] = []
    for r in sorted(_cached_repos(), key=lambda r: r.repo_id):
        listing = _repo_files(r)
        for quant, group in sorted(gguf_groups(listing).items()):
            try:
                _whole(quant, group)
            except ModelLoadError:
                continue  # parts missing: not a model yet
            size = sum(g.size for g in group)
            path = group[0].cached
            assert path is not None
            out.append(CachedModel(f"{r.repo_id}:{quant}", f"GGUF {quant}", size, path))
        weights = _weights(listing)
        config = next((f for f in listing if f.path == "config.json"), None)
        if weights is not None and config is not None and config.cached is not None:
            kind = weights.removeprefix("*.")
            size = sum(f.size for f in listing if f.path.endswith(kind))
            out.append(CachedModel(r.repo_id, kind, size, config.cached.parent))
    return out
