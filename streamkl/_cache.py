"""One small thread-safe LRU cache, used by every memo: the front end, the tile schedule, the backends' plans."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

_MISSING = object()


class LRUCache:
    """A bounded mapping that forgets its least recently used entry first.

    Every operation holds one lock, so a lookup's hit and its move to the recent end cannot race
    with another thread's eviction. Keys that hold `id()`s must also hold what makes them unique
    (the tensors' `_version`), and the value must keep those objects alive, so an id is not reused
    while its entry exists.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The kept value, or `make()`'s, kept. `make` runs outside the lock (it may compile or
        build schedules); when two threads make the same key at once, the first one kept wins."""
        value = self.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value = make()
        with self._lock:
            kept = self._data.setdefault(key, value)
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)
        return kept

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
