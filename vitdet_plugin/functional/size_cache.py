"""Bounded caches of tensors that depend on sizes alone (window masks, one-hot position keys):
an entry, a function of its key ``(sizes..., device, dtype)``, never goes stale; least recently
used entries go first, so a new image size every image cannot grow a cache without bound."""
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

import torch

T = TypeVar('T')

#: Number of sizes kept per cache (multi-scale training uses a handful per stage).
CACHE_SIZES = 16


class SizeCache(Generic[T]):
    """``cache.get(key, build)``: ``build()`` once per key, at most :data:`CACHE_SIZES` keys
    (LRU). Entries are built as normal tensors even under ``torch.inference_mode()`` (a later
    autograd forward may use them) and without autograd history.

    While ``torch.compile`` traces, keys may hold symbolic sizes (not hashable) and the built
    tensor becomes part of the graph anyway, so the cache is bypassed.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        if torch.compiler.is_compiling():
            return build()
        entry = self._entries.get(key)
        if entry is None:
            with torch.inference_mode(False), torch.no_grad():
                entry = build()
            self._entries[key] = entry
            while len(self._entries) > CACHE_SIZES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def clear(self) -> None:
        self._entries.clear()
