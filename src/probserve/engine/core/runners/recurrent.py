"""RecurrentRunner: the paged runner of a hybrid model (Qwen3.5: Gated DeltaNet layers among
attention ones, models/deltanet.py), whose sequences carry a recurrent state beside their KV
blocks.

A sequence's state (its conv and delta-rule state in every linear layer) is made, zeroed, when
its first token is computed, is carried past each chunk it computes, and goes with its blocks:
the scheduler drops it (`Sequence.runner_state`) when the sequence finishes or is preempted, and
a preempted sequence is recomputed from its first token, from zeros. At most `max_num_seqs`
sequences run, so at most that many states are held; the engine reserves their bytes out of
the KV cache's budget before it counts blocks (runners/choice.py).

Speculation: a step that verifies a sequence's proposals keeps the state past its last real
token and past each proposal (`RecurrentState.keep`); its next chunk's first position says how
many were accepted, and the state past the last of them is put back (`settle`): a rejected
proposal leaves no trace, and the numbers are the same bits as decoding one token a step. The
kept states (at most `--speculative-tokens` + 1 a sequence) are reserved with the others.

What it does not do: the prefix cache (no state snapshots at block boundaries are kept, so a
cached prefix could not restore its state: caching is off, `prefix_caching_off` says why).
Decode steps run the forward itself, not CUDA graphs (the states are per sequence).
"""

from __future__ import annotations

from typing import Any

from probserve.engine.config import EngineConfig
from probserve.engine.core.backend import Backend
from probserve.engine.core.runners.paged import PagedRunner
from probserve.engine.core.step import Chunk
from probserve.models.deltanet import RecurrentState, Span
from probserve.models.llama import state_shape
from probserve.models.loader import LoadedModel

NO_PREFIX_CACHE = "its recurrent state keeps no snapshots at block boundaries"


class RecurrentRunner(PagedRunner):
    prefix_caching = False  # (NO_PREFIX_CACHE)
    speculates = True  # (its states past each verify row kept, the accepted one put back)
    replays_graphs = False

    @staticmethod
    def state_bytes_per_sequence(config: Any) -> int:
        shape = state_shape(config)
        return shape.bytes if shape is not None else 0

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, config: EngineConfig, backend: Backend
    ) -> None:
        super().__init__(loaded, num_blocks, config, backend)
        shape = state_shape(loaded.model.config)
        assert shape is not None
        self.state_shape = shape

    def _spans(self, chunks: list[Chunk]) -> list[Span]:
        """Each chunk's rows and its sequence's state: a fresh one (zeros) at its first token,
        else the state past its last accepted token; with proposals, the states past its last
        real token and each proposal kept."""
        spans, row = [], 0
        for ch in chunks:
            state = ch.seq.runner_state
            if ch.start == 0 or not isinstance(state, RecurrentState):
                if ch.start != 0:  # (never: no prefix cache, preemption recomputes from 0)
                    raise RuntimeError(f"{ch.seq.request_id}: its recurrent state was lost")
                state = ch.seq.runner_state = RecurrentState.zeros(self.state_shape, self.device)
            state.settle(ch.start)
            keep = len(ch.proposed) + 1 if ch.proposed else 0
            if keep:
                state.keep(keep, ch.real_end - 1)
            spans.append(Span(row, row + ch.length, state, keep))
            row += ch.length
        return spans
