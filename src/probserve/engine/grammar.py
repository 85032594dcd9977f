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
    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise RequestError("this model's tokenizer cannot drive a grammar (not a fast one)", None)
    backend = copy.copy(backend)  # a copy without padding and truncation, as llguidance.hf does
    backend.no_padding()
    backend.no_truncation()
    eos: int | list[int] = eos_ids if eos_ids else tokenizer.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


def grammar_error(grammar: str, lltok: Any, limits: Any = None) -> str:
    """Why llguidance refuses `grammar` for this tokenizer ("" when it is valid)."""
    import llguidance

    ok_or_error: str = llguidance.LLMatcher.validate_grammar(grammar, lltok, limits=limits)
    return "" if ok_or_error.startswith("WARNING") else ok_or_error


def matcher_error(grammar: str, lltok: Any) -> str:
    """Why a matcher of `grammar` fails at its start ("" when it does not): what the check of
    the grammar alone passes and the engine would still refuse (a regex that matches nothing)."""
    import llguidance

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    matcher.compute_bitmask()  # some grammars fail only at their first mask
    return matcher.get_error().split("\n")[0] if matcher.is_error() else ""
