"""`RowBudget`: how many full-vocabulary rows the requests in flight may hold together."""

from __future__ import annotations

from probserve.api.errors import APIError


class RowBudget:
    """How many full-vocabulary rows the requests in flight may hold together (each is 192 KiB
    in float32 for a 49k vocabulary): a request that would pass the budget gets a 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, rows: int) -> None:
        """Reserve `rows` (a 429 past the budget); `give_back` them once the answer is sent."""
        if self.used + rows > self.limit:
            raise APIError(
                429,
                f"the server is busy ({self.used} of {self.limit} distribution rows in flight)",
                None,
                "overloaded",
                {"Retry-After": "1"},
            )
        self.used += rows

    def give_back(self, rows: int) -> None:
        self.used -= rows
