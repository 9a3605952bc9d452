"""Constructor argument checks shared by the backbones: each error names the argument and
what was given (ints stay ints, as :mod:`vitdet_plugin.functional.sizes` parses them)."""
import numbers
from typing import Mapping, Tuple

from ...functional.sizes import ArgumentError, is_int


def int_arg(value, name: str = 'value') -> int:
    """``value`` as an int; floats, strings or bools raise a ``ValueError``."""
    if not is_int(value):
        raise ArgumentError(f'{name} must be an int, got {value!r} ({type(value).__name__})')
    return int(value)


def positive_int(value, name: str = 'value', detail: str = '') -> int:
    """``value`` as an int > 0; anything else raises a ``ValueError`` naming ``name`` (with
    ``detail``, e.g. what the argument means, after "a positive int")."""
    if not is_int(value) or value <= 0:
        raise ArgumentError(f'{name} must be a positive int{detail}, got {value!r}')
    return int(value)


def int_tuple(values, name: str = 'value') -> Tuple[int, ...]:
    """An int or a sequence of ints as a tuple; floats, strings or bools raise a
    ``ValueError``."""
    if is_int(values):
        return (int(values), )
    if isinstance(values, (str, bytes)) or not hasattr(values, '__iter__'):
        raise ArgumentError(f'{name} must be an int or a sequence of ints, got {values!r}')
    values = tuple(values)
    bad = [v for v in values if not is_int(v)]
    if bad:
        raise ArgumentError(f'{name}={values!r} must hold ints only, not {bad!r}')
    return tuple(int(v) for v in values)


def check_flag(value, name: str) -> bool:
    """``value`` if it is a bool; anything else (``'yes'``, ``1``) raises a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f'{name} must be True or False, got {value!r} ({type(value).__name__})')
    return value


def positive_number(value, name: str) -> float:
    """``value`` as a float > 0 (bools and strings refused), else a ``ValueError``."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not float(value) > 0:
        raise ArgumentError(f'{name} must be positive, got {value!r}')
    return float(value)


def check_flags(**flags: object) -> None:
    """:func:`check_flag` on every keyword argument (named by its keyword)."""
    for name, value in flags.items():
        check_flag(value, name)


def check_rates(**rates: object) -> None:
    """:func:`check_rate` on every keyword argument (named by its keyword)."""
    for name, value in rates.items():
        check_rate(value, name)


def check_rate(value, name: str) -> float:
    """``value`` as a float in ``[0, 1)`` (a dropout or drop-path rate); anything else raises a
    ``ValueError`` naming the argument."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) \
            or not 0.0 <= float(value) < 1.0:
        raise ArgumentError(f'{name} must be a number in [0, 1), got {value!r}')
    return float(value)


#: Refused constructor options, and what replaces each (named in the error).
REMOVED_OPTIONS = {
    'accel': 'the models have one forward, the plain one, on every device; for CPU inference '
             'export the detector to ONNX and run it with onnxruntime (docs/deploy.md: '
             'tools/export_onnx.py, then tools/infer.py --backend onnxruntime)',
    'fused_attn': 'attention always runs F.scaled_dot_product_attention; for the explicit '
                  'formula wrap the call in vitdet_plugin.models.layers.eager_attention(model)',
}


def refuse_removed(owner: str, options: Mapping[str, object]) -> None:
    """A ``TypeError`` for any option left in ``options`` (a constructor's ``**removed``): the
    fix for the :data:`REMOVED_OPTIONS`, Python's own message for any other name."""
    for name in options:
        if name in REMOVED_OPTIONS:
            raise TypeError(f'{owner}({name}=...) was removed: {REMOVED_OPTIONS[name]}; delete '
                            f'{name} from the config')
        raise TypeError(f"{owner}.__init__() got an unexpected keyword argument '{name}'")


def head_dim(dim: int, num_heads: int) -> int:
    """Channels per attention head; a ``ValueError`` when ``num_heads`` does not divide ``dim``."""
    if num_heads <= 0 or dim % num_heads:
        raise ValueError(f'embed dims {dim} must be divisible by num_heads={num_heads}; '
                         'choose a head count that divides the channel count')
    return dim // num_heads
