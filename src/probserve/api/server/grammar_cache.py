"""Compiled grammars remembered per model: the same schema, regex or choice asked again (an
agent's every request, a classifier's every prompt) is compiled and checked once, not on
every request; the check is seconds of CPU for a big schema, taken from the engine's cores.
Bounded: the least recently used goes first. Only grammars that passed are kept."""

from __future__ import annotations

import threading
from collections import OrderedDict


class GrammarCache:
    def __init__(self, most: int = 256) -> None:
        self._most = most
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # the checks run on worker threads (off_loop)

    def get(self, key: str) -> str | None:
        with self._lock:
            grammar = self._items.get(key)
            if grammar is not None:
                self._items.move_to_end(key)
            return grammar

    def put(self, key: str, grammar: str) -> None:
        with self._lock:
            self._items[key] = grammar
            self._items.move_to_end(key)
            while len(self._items) > self._most:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
