"""Size arguments, parsed once for every backbone and weight converter: ``(h, w)`` pairs and
window sizes of ints that stay ints (``int()`` would truncate ``1.7``, parse ``'2'`` and accept
``True``); errors name the argument and what was given."""
import numbers
from typing import List, Optional, Sequence, Tuple, Union

#: A window: an int (square) or ``(h, w)``; per stage: one of those, or a sequence of them.
WindowArg = Union[int, Sequence[int], Sequence[Union[int, Sequence[int]]]]
Window = Tuple[int, int]


class ArgumentError(ValueError, AssertionError):
    """A constructor argument of the wrong value or form.

    A ``ValueError``, and also an ``AssertionError``: mmdet checks these arguments with
    ``assert``, so code written against mmdet's backbones (its own test suite's
    ``pytest.raises(AssertionError)``) catches ours the same way."""


def is_int(value: object) -> bool:
    """An integral number that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _pair_or_none(value: object) -> Optional[Window]:
    """``7 -> (7, 7)``, ``(7, 9) -> (7, 9)`` (a tuple, list or ``torch.Size``), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value), int(value))
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_int, value)):
        return (int(value[0]), int(value[1]))
    return None


def to_2tuple(value: object, name: str = 'value') -> Window:
    """``7 -> (7, 7)``; ``(7, 9) -> (7, 9)``; anything else (floats, strings, other lengths)
    raises an :class:`ArgumentError` naming what was given."""
    pair = _pair_or_none(value)
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


def stage_windows(value: WindowArg, num_stages: int, name: str, minimum: int,
                  pair_for_all: bool = True) -> Tuple[Window, ...]:
    """One ``(h, w)`` per stage from an int, one int / ``(h, w)`` per stage, or (with
    ``pair_for_all``) a pair of ints: one ``(h, w)`` for all stages, as in timm. Sides below
    ``minimum`` are refused (0 may mean "the stage's own window")."""
    windows: List[Optional[Window]] = [_pair_or_none(value)] * num_stages
    if isinstance(value, (tuple, list)):
        one_pair = pair_for_all and len(value) == 2 and all(map(is_int, value))
        if not one_pair:
            windows = ([_pair_or_none(v) for v in value] if len(value) == num_stages
                       else [None])
    found = [w for w in windows if w is not None]
    if len(found) != num_stages:
        form = 'an int or a pair (h, w), or' if pair_for_all else 'an int or'
        raise ValueError(f'{name} must be {form} one int or (h, w) pair per stage (the model '
                         f'has {num_stages} stages), got {value!r}')
    if any(min(w) < minimum for w in found):
        bound = 'positive' if minimum > 0 else f'>= {minimum} (0: the stage\'s own window)'
        raise ValueError(f'{name} must be {bound}, got {value!r}')
    return tuple(found)
