"""The sampler: logits processors, token choice and the logprobs of the choice, for a batch.

Processors apply in this order (each only when the request asks for it):
1. logit_bias (added to the logits),
2. min_tokens (EOS and stop token ids masked until min_tokens tokens are out),
3. repetition_penalty (prompt and output tokens; positive logits divided, negative multiplied),
   frequency_penalty (minus penalty x count in the output), presence_penalty (minus penalty
   once for each token present in the output),
4. temperature (skipped when greedy: temperature 0 means argmax),
5. top-k, 6. top-p (nucleus), 7. min-p (relative to the most likely token).

Sampling draws one uniform number and inverts the row's cumulative distribution; the number is
keyed by the request's seed and the token's position (`draw_seed`), not taken from a stream, so a
seeded request gives the same tokens whatever else shares the batch, and a position's draw is
the same whether its step verified speculative tokens before it or not (core/speculation.py).
A grammar's mask (core/grammar.py) comes before every processor: the tokens it does not allow
are -inf. Logprobs are raw (log_softmax of the model's logits, grammar or not) or processed
(log_softmax of the final distribution, grammar included; masked tokens -inf), per request;
a grammar's rows also carry `constraint_logmass`, the log of the raw mass it allowed.

The logits may be on the GPU path's device: greedy rows (alone or under a grammar's mask) are
chosen there (argmax: the first of equal maxima, as on the host), the rows with processors
are processed and drawn on the host (brought there in one copy), and the logprobs' reductions
run where the rows are (`RowMath`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from probserve.engine.core.logprobs import token_logprobs
from probserve.engine.core.row_math import RowMath
from probserve.engine.types import LogprobsMode, LogprobsSpec, SamplingParams, TokenLogprobs


@dataclass
class SamplerRow:
    """What the sampler needs to know about one sequence for this step."""

    params: SamplingParams
    logprobs: LogprobsSpec | None
    seed: int | None  # the sequence's draw seed (None: greedy)
    prompt_ids: torch.Tensor  # int64 [p]
    output_ids: Sequence[int]
    stop_ids: frozenset[int]  # ids min_tokens holds back (EOS unless ignored, stop_token_ids)
    allowed: torch.Tensor | None = None  # bool [V]: what a grammar allows next (None: no grammar)
    position: int = 0  # the position of the token drawn (its draw's key)

    @property
    def needs_processing(self) -> bool:
        return self.allowed is not None or self.params.needs_processing


@dataclass
class SamplerResult:
    token_ids: np.ndarray  # int64 [B]
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None]  # why a row failed (None: it did not)


def apply_penalties(logits: torch.Tensor, row: SamplerRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.cat([row.prompt_ids, torch.tensor(list(row.output_ids), dtype=torch.long)])
        seen = torch.unique(seen)
        vals = logits[seen]
        penalised = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # a tiny penalty divides positive logits past the float range: saturate them at the
        # largest float (the limit: the mass goes to them, evenly), never inf and then NaN
        big = torch.finfo(logits.dtype).max
        logits[seen] = torch.nan_to_num(
            penalised, nan=float("nan"), posinf=big, neginf=float("-inf")
        )
    if (p.frequency_penalty or p.presence_penalty) and len(row.output_ids):
        counts = torch.bincount(
            torch.tensor(list(row.output_ids), dtype=torch.long), minlength=logits.shape[0]
        ).to(logits.dtype)
        if p.frequency_penalty:
            logits -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_filters(logits: torch.Tensor, p: SamplingParams) -> None:
    """top-k, top-p and min-p, in place, masking with -inf."""
    vocab = logits.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits.masked_fill_(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))


def process_row(logits: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    """The processed logits of one row (a new tensor; `logits` is left as it is)."""
    p = row.params
    out = logits.clone()
    if row.allowed is not None:  # the grammar first: the rest processes what it allows
        if not bool(row.allowed.any()):
            raise ValueError("the grammar allows no token here")
        out.masked_fill_(~row.allowed, float("-inf"))
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        out.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=out.dtype))
    if len(row.output_ids) < p.min_tokens and row.stop_ids:
        out[torch.tensor(sorted(row.stop_ids), dtype=torch.long)] = float("-inf")
    apply_penalties(out, row)
    if not p.greedy and p.temperature != 1.0:
        # shifted so the largest logit is 0 first: dividing by a tiny temperature then gives
        # -inf for the others instead of overflowing to inf - inf = NaN (softmax is unchanged)
        out -= out.max()
        out /= p.temperature
        # a temperature below float32's range (5e-324) divides by 0: the largest logits, 0 after
        # the shift, give 0/0; their limit as the temperature goes to 0 is 0 (the others' -inf)
        out.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    apply_filters(out, p)
    return out


_MASK = 2**64 - 1


def draw_seed(seed: int, position: int) -> int:
    """The 64-bit key of the draw at `position` of a sequence seeded `seed` (splitmix64 of the
    two: neighbouring positions and seeds give unrelated draws)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _choose(row: SamplerRow, proc: torch.Tensor) -> int:
    if row.params.greedy:
        return int(torch.argmax(proc))
    # inverse-CDF draw with one uniform keyed by the seed and the position
    probs = torch.softmax(proc, dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = float(cdf[-1])
    if not total > 0.0 or not torch.isfinite(cdf[-1]):  # never pick an id silently
        raise FloatingPointError("the sampling distribution is not finite")
    generator = torch.Generator().manual_seed(draw_seed(row.seed or 0, row.position))
    u = torch.rand(1, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), proc.shape[0] - 1)


def sample(logits: torch.Tensor, rows: Sequence[SamplerRow], math: RowMath) -> SamplerResult:
    """Choose one token for each row of `logits` [B, V] and compute the logprobs asked for
    (their vocabulary reductions through `math`).

    A row that fails (NaN logits, an error in a processor) fails alone: its `errors` entry says
    why and the other rows are sampled as usual."""
    logits = logits.float()
    errors: list[str | None] = [None] * len(rows)
    bad = _nan_rows(logits)
    processed: list[torch.Tensor] = []
    chosen = torch.zeros(len(rows), dtype=torch.long)
    # greedy rows without processors: one argmax for all of them (ties: the lowest id, as per row)
    plain = [i for i, r in enumerate(rows) if r.params.greedy and not r.needs_processing]
    plain = [i for i in plain if not bad[i]]
    if plain:
        chosen[plain] = torch.argmax(logits[plain], dim=1).cpu()
    done = set(plain)
    # greedy rows whose one processor is a grammar's mask: masked and chosen together
    masked = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.needs_processing
              and r.allowed is not None and not bad[i] and bool(r.allowed.any())]  # fmt: skip
    masked_rows: dict[int, torch.Tensor] = {}
    if masked:
        masks = torch.stack([rows[i].allowed for i in masked]).to(logits.device)  # type: ignore[misc]
        block = logits[masked].masked_fill(~masks, float("-inf"))
        chosen[masked] = torch.argmax(block, dim=1).cpu()
        masked_rows = {i: block[j] for j, i in enumerate(masked)}
        done |= set(masked)
    # the rows processed or drawn on the host, brought there in one copy (the GPU path's)
    rest = [i for i in range(len(rows)) if i not in done and not bad[i]]
    on_host = logits.device.type == "cpu"
    moved = {} if on_host or not rest else dict(zip(rest, logits[rest].cpu(), strict=True))
    for i, row in enumerate(rows):
        if i in done:
            processed.append(masked_rows.get(i, logits[i]))
            continue
        try:
            if bad[i]:
                raise FloatingPointError("the model produced NaN logits")
            own = logits[i] if on_host else moved[i]
            proc = process_row(own, row) if row.needs_processing else own
            chosen[i] = _choose(row, proc)
        except Exception as exc:  # one request's failure must not fail the batch
            errors[i] = f"{type(exc).__name__}: {exc}"
            proc = logits[i]
        processed.append(proc)

    results: list[TokenLogprobs | None] = [None] * len(rows)
    ok = [i for i in range(len(rows)) if errors[i] is None and rows[i].logprobs]
    specs = {i: spec for i in ok if (spec := rows[i].logprobs) is not None}
    raw_idx = [i for i in ok if specs[i].mode != LogprobsMode.PROCESSED]
    proc_idx = [i for i in ok if specs[i].mode != LogprobsMode.RAW]
    raw = _logprobs_rows(math, logits[raw_idx] if raw_idx else None, raw_idx, chosen, specs)
    proc_rows = (
        torch.stack([processed[i].to(logits.device) for i in proc_idx]) if proc_idx else None
    )
    proc_lp = _logprobs_rows(math, proc_rows, proc_idx, chosen, specs)
    for i in ok:
        mode = specs[i].mode
        if mode == LogprobsMode.RAW:
            result = raw[i]
        elif mode == LogprobsMode.PROCESSED:
            result = proc_lp[i]
        else:
            result = dataclasses.replace(raw[i], processed=proc_lp[i])
        allowed = rows[i].allowed
        if allowed is not None:
            mass = constraint_logmass(math, logits[i], allowed)
            result = dataclasses.replace(result, constraint_logmass=mass)
        results[i] = result
    return SamplerResult(token_ids=chosen.numpy().copy(), logprobs=results, errors=errors)


def constraint_logmass(math: RowMath, logits: torch.Tensor, allowed: torch.Tensor) -> np.ndarray:
    """float32 [1]: log of the raw distribution's mass on the tokens a grammar allowed (0: it
    allowed them all), from the row's log-softmax through `math` (row-invariant where its
    kernels are)."""
    lsm = math.log_softmax(logits.unsqueeze(0))[0]
    if bool(allowed.all()):
        return np.zeros(1, dtype=np.float32)
    mass = torch.logsumexp(lsm[allowed.to(lsm.device)].double(), dim=0).float()
    return np.array([min(float(mass), 0.0)], dtype=np.float32)


def _nan_rows(logits: torch.Tensor) -> list[bool]:
    """Which rows hold a NaN: a row's sum is NaN if it does (or holds inf and -inf), so the
    whole-row check runs only where the cheap one fires."""
    suspects = torch.isnan(logits.sum(dim=1)).nonzero().flatten().tolist()
    bad = [False] * logits.shape[0]
    for i in suspects:
        bad[i] = bool(torch.isnan(logits[i]).any())
    return bad


def _logprobs_rows(
    math: RowMath,
    sources: torch.Tensor | None,
    idx: list[int],
    chosen: torch.Tensor,
    specs: Mapping[int, LogprobsSpec],
) -> dict[int, TokenLogprobs]:
    """The logprobs of rows `idx` (whose logits are `sources`), scored together with the largest
    k any of them asks; each row then takes its own k, target ids and entropy."""
    if not idx or sources is None:
        return {}
    k_max = max(specs[i].top_k for i in idx)
    block = token_logprobs(math, sources, chosen[idx], k_max)
    out: dict[int, TokenLogprobs] = {}
    for j, i in enumerate(idx):
        spec = specs[i]
        row = block.row(j, spec.top_k)
        if spec.target_ids or spec.entropy:
            extra = token_logprobs(math, sources[j : j + 1], chosen[i : i + 1], 0,
                                   spec.target_ids, spec.entropy)  # fmt: skip
            row = dataclasses.replace(
                row,
                target_logprobs=extra.target_logprobs,
                target_ids=extra.target_ids,
                entropy=extra.entropy,
            )
        out[i] = row
    return out
