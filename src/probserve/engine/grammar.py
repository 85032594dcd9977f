"""Grammars, the face both processes share (no torch): llguidance's view of the model's
tokenizer, and the check of a grammar against it (the API runs it before anything is
queued; the engine's matcher refuses an invalid one again: engine/core/grammar.py)."""

from __future__ import annotations

import copy
from typing import Any

from probserve.engine.types import RequestError


def llguidance_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """llguidance's view of a fast (Rust) tokenizer over the model's whole vocabulary: built
    once per model (a fraction of a second)."""
    return GrammarVocabulary.of(tokenizer, eos_ids).build(vocab_size)


class GrammarVocabulary:
    """What llguidance's tokenizer is built from, without the tokenizer: its serialized form
    (a copy without padding and truncation, as llguidance.hf makes) and its stop ids, or why
    it cannot drive a grammar. A process that builds llguidance's tokenizer only on its first
    grammar (the engine) keeps this in place of the tokenizer (tens of MB where the tokenizer
    takes hundreds: Qwen3.5's 248k-token one 211 MB, its form here 9)."""

    def __init__(self, serialized: bytes | None, eos: int | list[int]) -> None:
        self.serialized, self.eos = serialized, eos  # (UTF-8: 9 MB for Qwen3.5's, 15 as a str)

    @staticmethod
    def of(tokenizer: Any, eos_ids: list[int]) -> GrammarVocabulary:
        eos: int | list[int] = eos_ids if eos_ids else tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return GrammarVocabulary(None, eos)
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return GrammarVocabulary(backend.to_str().encode(), eos)

    def build(self, vocab_size: int) -> Any:
        import llguidance

        if self.serialized is None:
            raise RequestError(
                "this model's tokenizer cannot drive a grammar (not a fast one)", None
            )
        text = self.serialized.decode()
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=self.eos)


# llguidance's bounds on a grammar's parser, tighter than its defaults (50,000 items a step,
# 2,000 in a row): a highly ambiguous grammar then ends after tens of tokens and ~1 s of masks
# instead of minutes at up to 0.3 s a mask, while a 1,150-property schema (25,000 tokens)
# still peaks under 5 ms a mask. Where one is met partway, the sequence finishes
# "grammar_limit" (docs/logprobs.md).
STEP_MAX_ITEMS = 10_000
MAX_ITEMS_IN_ROW = 1_000


def parser_limits() -> Any:
    """The bounds every matcher of the server is built with (the API's check and the engine)."""
    import llguidance

    return llguidance.LLParserLimits(
        step_max_items=STEP_MAX_ITEMS, max_items_in_row=MAX_ITEMS_IN_ROW
    )


def grammar_error(grammar: str, lltok: Any, limits: Any = None) -> str:
    """Why llguidance refuses `grammar` for this tokenizer ("" when it is valid)."""
    import llguidance

    ok_or_error: str = llguidance.LLMatcher.validate_grammar(grammar, lltok, limits=limits)
    return "" if ok_or_error.startswith("WARNING") else ok_or_error


def first_line(error: str) -> str:
    """llguidance's message without what follows its first line (its parser state and the
    whole grammar: never sent to a client)."""
    return error.strip().split("\n")[0][:500]


def matcher_error(grammar: str, lltok: Any) -> str:
    """Why a matcher of `grammar` fails at its start ("" when it does not): what the check of
    the grammar alone passes and the engine would still refuse. Its first mask (a regex that
    matches nothing fails there), then one allowed token consumed: a grammar with no finite
    derivation (`start: "a" start`, a $ref cycle every value must take) or one whose lexer
    explodes (`(a{1000}){1000}`) meets llguidance's bounds at its very first token."""
    import llguidance
    import numpy as np

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    words = (lltok.vocab_size + 31) // 32
    bits = np.zeros(words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
    if not matcher.is_error():
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        stops = set(lltok.eos_tokens) | {lltok.eos_token}
        token = next((int(t) for t in allowed if int(t) not in stops), None)
        if token is not None:
            matcher.consume_token(token)
    return first_line(matcher.get_error()) if matcher.is_error() else ""
