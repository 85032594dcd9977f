"""The engine's side of speculative decoding (core/speculation.py): the proposer (prompt lookup,
or a draft model's engine, which the host builds: core/host.py), the requests' default
(`--speculative`), the most tokens proposed a step, and the totals (proposed tokens checked,
kept, kept by place among a step's). After each step, every sequence that drew tokens settles
its check and asks for its next proposals (`settle`: a grammar's forced tokens first); the
step's asks are answered together (`propose`), so a draft model runs once a step."""

from __future__ import annotations

from typing import Any

from probserve.engine.config import EngineConfig
from probserve.engine.core.grammar import Grammars
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.speculation import NgramProposer, Proposer, Speculation
from probserve.engine.stats import SPEC_POSITIONS

FORCED_MOST = SPEC_POSITIONS  # the most tokens a grammar's fast-forward proposes a step
Ask = tuple[str, list[int], int]  # (request id, its tokens, how many to propose)
# `--speculative auto`'s prompt lookup proposes for requests that did not ask only while at most
# this many sequences run: on text that does not repeat it cost 0-2% at 1 and 2 streams and
# 5-13% at 4 to 32 (bench/spec_cost.py, docs/benchmarks.md), where its checks' rows are no
# longer nearly free. Proposals change no bit, so the numbers are the same either way.
AUTO_MOST_RUNNING = 2


def default_mode(config: EngineConfig, device: str, hybrid: bool) -> str:
    """Requests' default speculation: `--speculative` as asked, its `auto` resolved: prompt
    lookup on the CPU engine for a model without a recurrent state (while at most
    AUTO_MOST_RUNNING sequences run: `Speculator.propose`), off on the GPU path (its decode
    graphs replay only steps without proposals) and for a hybrid model (each verify row keeps a
    recurrent state), where it was not measured."""
    if config.speculative != "auto":
        return config.speculative
    return "off" if device != "cpu" or hybrid else "ngram"


class Speculator:
    def __init__(self, proposer: Proposer, config: EngineConfig, default: str = "") -> None:
        self.proposer = proposer
        # requests' default (a request may ask, or not): `default_mode`'s
        self.default = default or config.speculative
        self.most = config.speculative_tokens
        # `auto`'s lookup: proposals for requests that did not ask only while few sequences run
        self.light = config.speculative == "auto"
        self.drafted = self.accepted = 0  # proposed tokens checked, and kept
        self.per_position = [0] * SPEC_POSITIONS  # kept, by place among a step's

    @classmethod
    def lookup(cls, config: EngineConfig, default: str = "") -> Speculator:
        """Prompt lookup's: what `--speculative ngram` runs, and what a request's `speculative:
        true` gets where the server's default is off (a draft model's engine is the host's to
        build: core/host.py)."""
        if config.speculative == "draft":
            raise ValueError(
                f"--speculative {config.speculative}: the draft model's engine is built by the "
                "host (core/host.py: engine_over)"
            )
        return cls(NgramProposer(), config, default)

    def figures(self) -> dict[str, Any]:
        """Its totals, as `EngineStats` names them."""
        return {
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_accepted_per_position": tuple(self.per_position),
        }

    def settle(
        self, seq: Sequence, checked: tuple[int, ...], accepted: int, running: bool
    ) -> Ask | None:
        """Settle the check of `checked` (`accepted` of them kept); a running sequence's next
        proposals: with a grammar, the tokens it forces (up to FORCED_MOST), set here; else
        (or where the grammar forces nothing) the proposer's ask."""
        spec = seq.speculation
        if spec is None:
            asked = seq.request.speculative
            if not (self.default != "off" if asked is None else asked):
                return None
            spec = seq.speculation = Speculation(self.most)
        if checked:
            self.drafted += len(checked)
            self.accepted += accepted
            for j in range(min(accepted, SPEC_POSITIONS)):
                self.per_position[j] += 1
        spec.proposed = checked
        spec.settle(accepted, self.most)
        if not running:
            return None
        # the drawn token after them; a step checks at most SPEC_POSITIONS
        room = min(seq.max_total_tokens - seq.num_tokens - 1, SPEC_POSITIONS)
        if seq.matcher is not None:
            spec.proposed = Grammars.forced(seq.matcher, min(FORCED_MOST, room))
            if spec.proposed:
                return None
        if spec.resting():  # its latest guesses kept nothing
            return None
        # (a grammar's masks ahead stop the check at a proposal it refuses)
        return seq.request_id, seq.token_ids, min(spec.limit, room)

    def propose(self, asks: list[tuple[Sequence, Ask]], running: int) -> None:
        """The step's proposals, every asking sequence's from one call of the proposer; with
        `auto` and more than AUTO_MOST_RUNNING sequences `running`, only those of requests that
        asked for speculation (`speculative: true`), the others none this step."""
        if self.light and running > AUTO_MOST_RUNNING:
            for seq, _ in asks:
                if seq.request.speculative is None and seq.speculation is not None:
                    seq.speculation.proposed = ()
            asks = [(seq, ask) for seq, ask in asks if seq.request.speculative]
        if not asks:
            return
        got = self.proposer.propose_many([ask for _, ask in asks])
        for seq, (rid, _, _) in asks:
            if seq.speculation is not None:
                seq.speculation.proposed = got.get(rid, ())
