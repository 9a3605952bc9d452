"""Size arguments, parsed once for every backbone and weight converter: ``(h, w)`` pairs and
window sizes of ints that stay ints (``int()`` would truncate ``1.7``, parse ``'2'`` and accept
``True``); errors name the argument and what was given."""
import numbers
from typing import Optional, Tuple

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
