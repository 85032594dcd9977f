"""PrefixAffinityRouter: Ray Serve request routing that sends a prompt to the replica holding
its longest prefix in its KV cache (lm-evaluation-harness sends 4+ continuations of each
context: they all land where the context's blocks are), unless that replica's queue is longer
than the shortest by more than `imbalance` requests; prompts no replica holds go to the least
loaded one.

The router remembers, for the whole blocks of each prompt it routes (the engine's block size and
the engine's own chained SHA-256 block hashes), which replica got them, as a bounded
least-recently-used map. It runs wherever the deployment's handle is: in the ingress.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from probserve.engine.prefix_hash import BlockHash, block_hash
from probserve.engine.types import EngineRequest


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(
        self, block_size: int = 16, imbalance: int = 8, capacity: int = 200_000, **_: Any
    ) -> None:
        self.block_size = block_size
        self.imbalance = imbalance  # queue length a prefix match may cost over the shortest
        self.capacity = capacity  # block hashes remembered
        self.owners: OrderedDict[BlockHash, ReplicaID] = OrderedDict()

    def prefix_hashes(self, pending: PendingRequest | None) -> list[BlockHash]:
        """The chained hashes of the whole blocks of the request's prompt (none for a call
        that is not a generate request)."""
        if pending is None or not pending.args or not isinstance(pending.args[0], EngineRequest):
            return []
        ids = pending.args[0].prompt_token_ids
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, ids[start : start + self.block_size])
            hashes.append(parent)
        return hashes

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranked = sorted(candidate_replicas, key=self._load)
        by_id = {r.replica_id: r for r in candidate_replicas}
        hashes = self.prefix_hashes(pending_request)
        choice = ranked[0]
        for h in reversed(hashes):  # the longest prefix held
            owner = by_id.get(self.owners.get(h))  # type: ignore[arg-type]
            if owner is not None:
                if self._load(owner) <= self._load(choice) + self.imbalance:
                    choice = owner
                break
        # claimed now, not once routed: the siblings of this prompt that are being routed at
        # the same moment (lm-eval's continuations arrive together) follow it
        self._claim(hashes, choice.replica_id)
        return [[choice], [r for r in ranked if r is not choice]]

    def _claim(self, hashes: list[BlockHash], replica_id: ReplicaID) -> None:
        for h in hashes:
            self.owners[h] = replica_id
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._claim(self.prefix_hashes(pending_request), replica_id)  # where it really went

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self.owners.items() if r == replica_id]:
            del self.owners[h]
