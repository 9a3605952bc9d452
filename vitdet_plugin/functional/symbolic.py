"""Size decisions that hold for symbolic sizes (``torch.compile(dynamic=True)``, ``torch.export``).

Under dynamic shapes a size is a ``SymInt``; a Python branch on it (``if pad:``) makes the
compiler record a guard (a recompilation when another size takes the other branch) and makes
``torch.export`` specialise or fail on the dimension. :func:`known_zero` branches only on what
is known without a guard: plain ints (eager, static compiles) keep their fast path, symbolic
sizes take the general one (e.g. a pad that may be zero at run time).
"""
from typing import Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

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
