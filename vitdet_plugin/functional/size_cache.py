"""Bounded caches of tensors that depend on sizes alone (window masks, one-hot position keys):
an entry, a function of its key ``(sizes..., device, dtype)``, never goes stale; least recently
used entries go first, so a new image size every image cannot grow a cache without bound."""
import functools
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

import torch

T = TypeVar('T')
FuncT = TypeVar('FuncT', bound=Callable)

#: Default number of sizes kept per cache (multi-scale training uses a handful per stage).
DEFAULT_CACHE_SIZES = 16


def builds_cache(fn: FuncT) -> FuncT:
    """Decorate a function that builds tensors kept across calls: they are made as normal
    tensors even under ``torch.inference_mode()`` (a later autograd forward may use them) and
    without autograd history."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


class SizeCache(Generic[T]):
    """``cache.get(key, build)``: ``build()`` once per key, at most ``maxsize`` keys (LRU).

    While ``torch.compile`` traces, keys may hold symbolic sizes (not hashable) and the built
    tensor becomes part of the graph anyway, so the cache is bypassed.
    """

    def __init__(self, maxsize: int = DEFAULT_CACHE_SIZES) -> None:
        if maxsize <= 0:
            raise ValueError(f'maxsize must be positive, got {maxsize}')
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        if torch.compiler.is_compiling():
            return build()
        entry = self._entries.get(key)
        if entry is None:
            entry = builds_cache(build)()
            self._entries[key] = entry
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
