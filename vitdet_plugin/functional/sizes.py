"""Sizes: constructor size arguments parsed once for every backbone and weight converter
(``(h, w)`` pairs and window sizes of ints that stay ints: ``int()`` would truncate ``1.7``,
parse ``'2'`` and accept ``True``; errors name the argument and what was given), size decisions
that hold for symbolic sizes, and bounded caches of tensors that depend on sizes alone.

Symbolic sizes (``torch.compile(dynamic=True)``, ``torch.export``): a size is a ``SymInt``; a
Python branch on it (``if pad:``) makes the compiler record a guard (a recompilation when
another size takes the other branch) and makes ``torch.export`` specialise or fail on the
dimension. :func:`known_zero` branches only on what is known without a guard: plain ints (eager,
static compiles) keep their fast path, symbolic sizes take the general one (e.g. a pad that may
be zero at run time).

Caches (:class:`SizeCache`): an entry, a function of its key ``(sizes..., device, dtype)``, never
goes stale; least recently used entries go first, so a new image size every image cannot grow a
cache without bound.
"""
import numbers
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Optional, Tuple, TypeVar, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

Window = Tuple[int, int]


class ArgumentError(ValueError, AssertionError):
    """A constructor argument of the wrong value or form.

    A ``ValueError``, and also an ``AssertionError``: mmdet checks these arguments with
    ``assert``, so code written against mmdet's backbones (its own test suite's
    ``pytest.raises(AssertionError)``) catches ours the same way."""


def is_int(value: object) -> bool:
    """An integral number that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def pair_or_none(value: object) -> Optional[Window]:
    """``7 -> (7, 7)``, ``(7, 9) -> (7, 9)`` (a tuple, list or ``torch.Size``), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value), int(value))
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_int, value)):
        return (int(value[0]), int(value[1]))
    return None


def to_2tuple(value: object, name: str = 'value') -> Window:
    """``7 -> (7, 7)``; ``(7, 9) -> (7, 9)``; anything else (floats, strings, other lengths)
    raises an :class:`ArgumentError` naming what was given."""
    pair = pair_or_none(value)
    if pair is None:
        raise ArgumentError(f'{name} must be an int or a pair of ints (h, w), got {value!r} '
                            f'({type(value).__name__})')
    return pair


def window_pair(value: object, name: str = 'window_size', hint: str = '') -> Window:
    """A positive window ``(wh, ww)`` from an int or a pair (:func:`to_2tuple`); ``hint`` is
    appended to the error of a non-positive side."""
    pair = to_2tuple(value, name)
    if min(pair) <= 0:
        raise ArgumentError(f'{name} must be positive, got {value!r}{hint}')
    return pair


SizeLike = Union[int, torch.SymInt]


def _known_true(condition: object) -> bool:
    """``condition`` when it is a plain bool; for a ``SymBool``, whether it holds for every input
    without adding a guard; anything else (a 0-d tensor: ``torch.jit.trace`` records sizes as
    tensors) is not known, so False."""
    if isinstance(condition, (bool, torch.SymBool)):
        return statically_known_true(condition)
    return False


def known_zero(*sizes: SizeLike) -> bool:
    """True when every size is 0 for every input the traced graph serves (for plain ints: when
    it is 0); never adds a guard."""
    return all(_known_true(s == 0) for s in sizes)


def known_equal(a: SizeLike, b: SizeLike) -> bool:
    """``a == b`` for plain ints; for symbolic (or jit-traced) sizes True only when provably
    equal."""
    return _known_true(a == b)


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
