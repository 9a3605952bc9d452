"""2-D rotary position embedding (RoPE) of the ViT families: EVA-02's and DINOv3's.

Both rotate channel pairs of the patch tokens' queries and keys by ``coordinate * frequency``, a
quarter of the head channels per axis, so a logit depends on relative position only; they differ
in frequencies, coordinates and pairing (docs/backbones.md). :func:`rope_tables` gives the cached
``(sin, cos)`` tables of a grid (``extent``: of a padded grid, the coordinates continuing past
the edge); :func:`apply_rope` rotates with them.
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .sizes import SizeCache

#: The formulations :class:`RopeSpec` accepts.
ROPE_FORMULATIONS = ('eva02', 'dinov3')
#: Head channels per rotated frequency: two axes, each rotating pairs of channels.
CHANNELS_PER_FREQUENCY = 4
#: DINOv3's token coordinates span ``[-1, 1]``: ``2 * centre - 1``.
DINOV3_SPAN = 2.0

_TABLES: SizeCache[Tuple[Tensor, Tensor]] = SizeCache()


class RopeSpec(NamedTuple):
    """The settings of a rotary embedding (hashable: part of the table cache key): the
    formulation, the head dim (a multiple of 4), the frequency base and EVA-02's pretraining
    token grid the coordinates are rescaled onto (None: plain indices; DINOv3 ignores it)."""
    formulation: str
    head_dim: int
    temperature: float
    ref_grid: Optional[Tuple[int, int]] = None

    @property
    def rotate_half(self) -> bool:
        """DINOv3 rotates halves, EVA-02 interleaved pairs."""
        return self.formulation == 'dinov3'


def check_rope_spec(spec: RopeSpec) -> RopeSpec:
    """``spec`` if it is usable, else a ``ValueError`` naming the fix."""
    if spec.formulation not in ROPE_FORMULATIONS:
        raise ValueError(f'rope formulation {spec.formulation!r} is not one of '
                         f'{list(ROPE_FORMULATIONS)}')
    if spec.head_dim <= 0 or spec.head_dim % CHANNELS_PER_FREQUENCY:
        raise ValueError(f'rotary embedding needs a head dim divisible by '
                         f'{CHANNELS_PER_FREQUENCY} (two axes of channel pairs), got '
                         f'{spec.head_dim}; choose embed_dims / num_heads accordingly')
    return spec


def rope_frequencies(spec: RopeSpec, device: Optional[torch.device] = None) -> Tensor:
    """The ``(head_dim / 4,)`` angular frequencies per unit coordinate (float32)."""
    count = spec.head_dim // CHANNELS_PER_FREQUENCY
    i = torch.arange(count, device=device, dtype=torch.float32)
    if spec.formulation == 'eva02':
        return spec.temperature ** (-i / count)
    periods = spec.temperature ** (2.0 * i / (spec.head_dim // 2))
    return 2.0 * math.pi / periods


def rope_axis_coords(spec: RopeSpec, length: int, axis: int, extent: Optional[int] = None,
                     device: Optional[torch.device] = None) -> Tensor:
    """Coordinates ``(extent,)`` of the tokens along one axis of a ``length``-token grid
    (``extent >= length`` continues past the edge; float32)."""
    pos = torch.arange(length if extent is None else extent, device=device,
                       dtype=torch.float32)
    if spec.formulation == 'eva02':
        return pos if spec.ref_grid is None else pos / length * spec.ref_grid[axis]
    return DINOV3_SPAN * (pos + 0.5) / length - 1.0


def _build_tables(spec: RopeSpec, grid: Tuple[int, int], extent: Tuple[int, int],
                  device: Optional[torch.device], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    freqs = rope_frequencies(spec, device)                                  # (F,)
    rows = rope_axis_coords(spec, grid[0], 0, extent[0], device)[:, None] * freqs  # (Hp, F)
    cols = rope_axis_coords(spec, grid[1], 1, extent[1], device)[:, None] * freqs  # (Wp, F)
    hp, wp, f = rows.shape[0], cols.shape[0], freqs.shape[0]
    angles = torch.cat([rows[:, None, :].expand(hp, wp, f),
                        cols[None, :, :].expand(hp, wp, f)], dim=-1)       # (Hp, Wp, 2F)
    angles = angles.reshape(hp * wp, 2 * f)                                 # (N, d / 2)
    if spec.rotate_half:
        angles = torch.cat([angles, angles], dim=-1)                        # (N, d) halves
    else:
        angles = angles.repeat_interleave(2, dim=-1)                        # (N, d) pairs
    return angles.sin().to(dtype), angles.cos().to(dtype)


def rope_tables(spec: RopeSpec, grid: Tuple[int, int], extent: Optional[Tuple[int, int]] = None,
                device: Optional[torch.device] = None,
                dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """``(sin, cos)``, each ``(Hp * Wp, head_dim)`` row-major, for the tokens of a ``grid``
    (``(h, w)``) map, or of its ``extent`` (``(Hp, Wp)`` >= grid: a padded map), in the layout
    :func:`apply_rope` expects for ``spec``. Cached per (spec, grid, extent, device, dtype);
    do not write into them."""
    full = (grid[0], grid[1]) if extent is None else (extent[0], extent[1])
    key = (spec, tuple(grid), full, device, dtype)
    return _TABLES.get(key, lambda: _build_tables(spec, grid, full, device, dtype))


def rotate_pairs(x: Tensor) -> Tensor:
    """EVA-02's rotation partner: ``(x0, x1, x2, x3, ...)`` -> ``(-x1, x0, -x3, x2, ...)``."""
    pairs = x.unflatten(-1, (-1, 2))                                        # (..., d / 2, 2)
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def rotate_halves(x: Tensor) -> Tensor:
    """DINOv3's rotation partner: ``(a, b)`` halves -> ``(-b, a)``."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: Tensor, sin: Tensor, cos: Tensor, rotate_half: bool) -> Tensor:
    """Rotate ``x`` ``(..., N, d)`` by the tables ``(N, d)`` (or anything broadcastable); the
    result has ``x``'s dtype (the products are formed in the tables' precision)."""
    partner = rotate_halves(x) if rotate_half else rotate_pairs(x)
    return (x * cos + partner * sin).to(x.dtype)
