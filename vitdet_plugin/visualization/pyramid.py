"""A config's input padding and the feature pyramid it gives: the rows that
``tools/analysis/feature_shapes.py`` prints, the padded sizes every analysis tool feeds."""
from typing import Any, Dict, List, Sequence, Tuple, Union

from mmengine.config import Config
from torch import Tensor

#: One pyramid level: name, channels, nominal stride and ``(B, C, H, W)`` shape.
Row = Tuple[str, int, str, str]


def pad_size_divisor(cfg: Config) -> int:
    """The ``pad_size_divisor`` of the config's data preprocessor (1 when it pads nothing)."""
    return int(cfg.model.get('data_preprocessor', {}).get('pad_size_divisor', 1) or 1)


def padded_shape(shape: Sequence[int], divisor: int) -> Tuple[int, int]:
    """``(H, W)`` rounded up to multiples of ``divisor``, as the data preprocessor pads."""
    h, w = shape
    if divisor <= 1:
        return h, w
    return -(-h // divisor) * divisor, -(-w // divisor) * divisor


def nominal_stride(input_hw: Sequence[int], map_hw: Sequence[int]) -> str:
    """The stride a level is built for: the integer ``s`` for which ``floor`` or ``ceil`` of
    ``input / s`` gives the map's size on both sides (a power of two when one fits, e.g. the
    extra levels of an 800x1216 input: 13x19 maps, stride 64, not ``61.5x64``); the measured
    ratio when none fits."""
    (h, w), (mh, mw) = input_hw, map_hw

    def fits(size: int, side: int, s: int) -> bool:
        return side in (size // s, -(-size // s))

    fitting = [s for s in range(1, max(h, w) + 1) if fits(h, mh, s) and fits(w, mw, s)]
    powers = [s for s in fitting if s & (s - 1) == 0]
    if powers or fitting:
        return str(powers[0] if powers else min(fitting, key=lambda s: abs(s - h / mh)))
    return f'{h / mh:g}x{w / mw:g}'


def pyramid_rows(prefix: str, feats: Union[Tensor, Sequence[Tensor], Dict[Any, Tensor]],
                 input_hw: Tuple[int, int]) -> List[Row]:
    """``(name, channels, nominal stride, shape)`` rows of a tensor / list / dict of NCHW
    maps."""
    if isinstance(feats, Tensor):
        feats = [feats]
    items = feats.items() if isinstance(feats, dict) else enumerate(feats)
    return [(f'{prefix}[{key}]', int(f.shape[1]),
             nominal_stride(input_hw, (int(f.shape[-2]), int(f.shape[-1]))), str(tuple(f.shape)))
            for key, f in items]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table under a header."""
    header = ('name', 'channels', 'stride', 'shape (B, C, H, W)')
    cells = [header] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)
