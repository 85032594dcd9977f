"""Constrained decoding in the engine: one llguidance matcher per sequence with a grammar,
the tokens it allows at each step as a boolean row over the model's vocabulary, and the
tokens it consumes as they are sampled. A grammar's matcher is built once and kept at its
start (the most recent TEMPLATES of them): each sequence gets a copy (microseconds, where a
build is up to a fraction of a second), so n candidates of one schema cost one build.

The matcher's state is the sequence's output tokens, which outlive preemption (recompute
keeps them), so nothing needs replaying; the stop ids (EOS, stop_token_ids) are allowed
wherever the grammar may end."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from probserve.engine.grammar import GrammarVocabulary, first_line, parser_limits
from probserve.engine.types import RequestError

TEMPLATES = 32  # grammars whose pristine matcher is kept


class Grammars:
    """The model's llguidance tokenizer (built once, on first use: ~0.3 s) and the matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf = tokenizer  # (None once `release_tokenizer` keeps its vocabulary alone)
        self._vocabulary: GrammarVocabulary | None = None
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._lltok: Any = None
        self._pool: ThreadPoolExecutor | None = None  # the masks' thread, started on first use
        self._templates: OrderedDict[str, Any] = OrderedDict()  # grammar -> matcher at its start

    def start(
        self, seqs: list[Any], proposed: dict[str, tuple[int, ...]] | None = None
    ) -> Future[dict[str, list[torch.Tensor]]]:
        """The masks of `seqs` that have a grammar (by request id), computed on a thread of
        their own while the caller runs the model: llguidance and the kernels both run without
        the GIL. The matchers are not touched until the result is taken. Each sequence's list
        holds its next position's mask, then, for tokens `proposed` past its end (speculative
        decoding), the mask after each of them (a copy of the matcher consumes them; the list
        stops at one the grammar refuses)."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            done: Future[dict[str, list[torch.Tensor]]] = Future()
            done.set_result({})
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="probserve-grammar")
        ahead = proposed or {}

        def masks() -> dict[str, list[torch.Tensor]]:
            rows = self.allowed_rows([s.matcher for s in constrained],
                                     [s.stop_ids for s in constrained])  # fmt: skip
            out = {s.request_id: [rows[i]] for i, s in enumerate(constrained)}
            for s in constrained:
                tokens = ahead.get(s.request_id, ())
                if not tokens:
                    continue
                # a copy consumes them: llguidance's rollback does not undo every bound (a
                # thinking budget's token count), so the sequence's own matcher is never moved
                probe = s.matcher.deep_copy()
                for token in tokens:
                    if probe.try_consume_tokens([token]) != 1:
                        break
                    out[s.request_id].append(self.allowed(probe, s.stop_ids))
            return out

        return self._pool.submit(masks)

    @staticmethod
    def forced(matcher: Any, most: int) -> tuple[int, ...]:
        """Up to `most` tokens the grammar forces next (llguidance's fast-forward tokens: a
        JSON key, its punctuation, the rest of a choice), as speculative proposals."""
        if most <= 0 or matcher.is_stopped() or matcher.is_error():
            return ()
        return tuple(int(t) for t in matcher.compute_ff_tokens()[:most])

    def tokenizer(self) -> Any:
        if self._lltok is None:
            self._lltok = self._vocabulary_of().build(self.vocab_size)
        return self._lltok

    def _vocabulary_of(self) -> GrammarVocabulary:
        if self._vocabulary is None:
            self._vocabulary = GrammarVocabulary.of(self._hf, self._eos)
        return self._vocabulary

    def release_tokenizer(self) -> None:
        """Keep what llguidance's tokenizer is built from, not the model's tokenizer: the
        engine's process needs nothing else of it once started (the API's process holds its
        own), and the same grammars are built from it."""
        self._vocabulary_of()
        self._hf = None

    def ready(self, grammar: str) -> bool:
        """Whether `grammar`'s matcher is built (a new sequence of it costs a copy)."""
        return grammar in self._templates

    def matcher(self, grammar: str) -> Any:
        """A matcher at the grammar's start (a copy of the kept one); a grammar llguidance
        refuses is a RequestError."""
        import llguidance

        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(
                self.tokenizer(), grammar, log_level=0, limits=parser_limits()
            )
            if template.is_error():
                why = first_line(template.get_error())
                raise RequestError(f"the grammar is not valid: {why}", "grammar")
            self._templates[grammar] = template
            while len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        self._templates.move_to_end(grammar)
        return template.deep_copy()

    def allowed(self, matcher: Any, stop_ids: frozenset[int]) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next (the stop ids where it may end)."""
        return self.allowed_rows([matcher], [stop_ids])[0]

    def allowed_rows(self, matchers: list[Any], stop_ids: list[frozenset[int]]) -> torch.Tensor:
        """bool [n, vocab]: `allowed` for several matchers at once (one buffer, one unpack)."""
        words = (self.vocab_size + 31) // 32
        bits = np.empty((len(matchers), words), dtype=np.int32)
        for i, matcher in enumerate(matchers):  # each call runs without the GIL
            matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, words * 4)
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        mask = unpacked[:, : self.vocab_size].astype(bool)
        for i, matcher in enumerate(matchers):
            if matcher.is_accepting():
                mask[i, [t for t in stop_ids[i] if t < self.vocab_size]] = True
        return torch.from_numpy(mask)
