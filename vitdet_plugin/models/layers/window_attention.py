"""Swin window attention: the shared :class:`Attention` plus a relative-position bias table.

The relative-position index is a non-persistent buffer; the gathered ``(heads, N, N)`` bias and
its sum with a shift mask are cached while they cannot change (no autograd graph is being
recorded through the table) and rebuilt whenever the table changes (see
:class:`~.tensor_watch.TensorWatch`), so inference never rebuilds them and training always
sees the current parameters.
"""
import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .attention import MASKED_LOGIT, Attention, attend, combine_bias
from .chunking import map_row_chunks, rows_per_chunk
from .rel_pos import bias_table_size, relative_position_index
from .tensor_watch import TensorWatch, builds_cache
from .window import window_partition


#: Inference biases kept per module: the plain and the masked one of the current size, and
#: those of a second size when two alternate.
BIAS_CACHE_ENTRIES = 4


class WindowAttention(Attention):
    """Multi-head attention inside ``wh x ww`` windows with a learned relative-position bias.

    Args:
        dim: token channels.
        num_heads: attention heads.
        window_size: ``(wh, ww)``.
        qkv_bias, attn_drop, proj_drop, fused: see :class:`Attention`.
        qk_scale: override of the ``head_dim ** -0.5`` logit scale (mmdet's ``qk_scale``;
            as there and in the official code, ``None`` or ``0`` mean the default).
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int],
                 qkv_bias: bool = True, qk_scale: Optional[float] = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, fused,
                         qk_scale or None)  # `qk_scale or head_dim ** -0.5` upstream
        self.window_size = tuple(window_size)
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros(math.prod(bias_table_size(self.window_size)), num_heads))
        # the index is derived from window_size, per device, rather than kept as a buffer: a
        # non-persistent buffer is neither loaded nor re-initialised, so a model built on the
        # meta device and materialised with to_empty() would index with garbage
        self._index_by_device: Dict[torch.device, Tensor] = {}
        self._cache: Dict[tuple, Tuple[Optional[Tensor], Tensor]] = {}
        self._table_watch = TensorWatch()

    def _cacheable(self) -> bool:
        return not (torch.is_grad_enabled() and self.relative_position_bias_table.requires_grad)

    def relative_position_bias(self) -> Tensor:
        """The ``(1, heads, N, N)`` bias for one window.

        4-D on purpose: with a 3-D mask ``F.scaled_dot_product_attention`` falls back from
        the fused CPU kernel to the math path.
        """
        n = self.window_tokens
        table = self.relative_position_bias_table
        bias = table[self._flat_index(table.device)].view(n, n, -1)
        return bias.permute(2, 0, 1).unsqueeze(0)

    @builds_cache  # indexes a table that may be recorded for backward
    def _flat_index(self, device: torch.device) -> Tensor:
        """:func:`relative_position_index` of the window, flattened, on ``device``."""
        index = self._index_by_device.get(device)
        if index is None:
            index = relative_position_index(self.window_size).view(-1).to(device)
            self._index_by_device[device] = index
        return index

    @builds_cache  # a cached bias may join a later autograd graph (frozen table)
    def window_bias(self, shift_mask: Optional[Tensor], batch: Optional[int] = None) -> Tensor:
        """Inference bias: ``(1, heads, N, N)``, or with a ``(nW, N, N)`` shift mask
        ``(nW, heads, N, N)`` repeated to ``batch`` windows (a multiple of ``nW``); cached
        until the table changes (a few entries: the masks of the current feature size)."""
        # keyed on the mask object; the entry holds the mask, so its id cannot be reused
        key = (None if shift_mask is None else id(shift_mask), batch)
        if self._table_watch.changed(self.relative_position_bias_table):
            self._cache.clear()
        entry = self._cache.get(key)
        if entry is None:
            mask = None if shift_mask is None else shift_mask.unsqueeze(1)
            batch = batch or (1 if mask is None else mask.shape[0])
            bias = combine_bias(self.relative_position_bias(), mask, batch).contiguous()
            while len(self._cache) >= BIAS_CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))              # oldest first
            entry = self._cache[key] = (shift_mask, bias)
        return entry[1]

    def forward(self, x: Tensor, shift_mask: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        """``x``: windows ``(B * nW, N, C)``; ``shift_mask``: ``(nW, N, N)`` additive or None."""
        if self._cacheable():
            bias = self.window_bias(shift_mask, x.shape[0])
            # inference: windows in chunks keep the 3C-wide qkv temporary small
            rows = self.windows_per_chunk(x.element_size())
            return map_row_chunks(self.forward_with_bias, x, rows, self.dim, bias)
        # training: the bias carries a gradient; the mask stays separate and unexpanded
        mask = None if shift_mask is None else shift_mask.unsqueeze(1)
        return super().forward(x, self.relative_position_bias(), mask)

    def forward_with_bias(self, x: Tensor, bias: Tensor) -> Tensor:
        """Windows ``(W, N, C)`` with a ready bias ``(1 | W, heads, N, N)``, e.g. rows of
        :meth:`window_bias` for a chunk of windows."""
        return super().forward(x, bias)

    def forward_tokens(self, x: Tensor, real: Optional[Tensor], windows: int,
                       bias: Tensor) -> Tensor:
        """Inference on the image tokens of ``windows`` windows, padding left implicit.

        ``x``: ``(R, C)`` normalised image tokens in window order; ``real``: their positions
        among the ``windows * N`` window tokens (None: no padding, ``R = windows * N``);
        ``bias``: ``(1 | windows, heads, N, N)``. Padding tokens are zeros after the norm (the
        detection semantics), so their ``qkv`` rows are just the ``qkv`` bias: they take part
        as keys and values without a GEMM row, and their outputs are never projected.
        Returns ``(R, C)``.
        """
        qkv = self.qkv(x)
        if real is not None:
            full = qkv.new_empty(windows * self.window_tokens, qkv.shape[1])
            if self.qkv.bias is not None:
                full.copy_(self.qkv.bias.expand_as(full))
            else:
                full.zero_()
            qkv = full.index_copy_(0, real, qkv)
        q, k, v = self.split_heads(qkv.view(windows, self.window_tokens, -1))
        out = self.merge_heads(attend(q, k, v, bias, fused=self.fused, scale=self.scale))
        out = out.reshape(-1, self.dim)                              # (windows * N, C)
        if real is not None:
            out = out.index_select(0, real)
        return self.project(out)

    @property
    def window_tokens(self) -> int:
        return self.window_size[0] * self.window_size[1]

    def windows_per_chunk(self, element_size: int = 4) -> int:
        """Windows per inference chunk (keeps the ``3C``-wide qkv temporary near
        :data:`~.chunking.CHUNK_BYTES`)."""
        return rows_per_chunk(3 * self.dim * self.window_tokens, element_size)

    def train(self, mode: bool = True) -> 'WindowAttention':
        self._clear_cache()
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):  # device/dtype moves invalidate the cache
        self._clear_cache()
        return super()._apply(fn, recurse)

    def _clear_cache(self) -> None:
        self._cache.clear()
        self._table_watch.reset()

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}, ' + super().extra_repr()


def shifted_window_mask(hw: Tuple[int, int], window_size: Tuple[int, int],
                        shift_size: Tuple[int, int], device: Optional[torch.device] = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive mask ``(nW, N, N)`` for shifted-window attention on a padded ``(Hp, Wp)`` map.

    After the cyclic shift by ``-shift_size``, windows on the bottom/right border mix tokens from
    up to four image regions; tokens may only attend within their own region (others get
    :data:`MASKED_LOGIT`). Region layout as in the Swin detection code: slices
    ``[0, -w)``, ``[-w, -s)``, ``[-s, end)`` per axis.
    """
    hp, wp = hw
    region = torch.zeros(1, hp, wp, 1, device=device)
    label = 0
    for hs in _shift_slices(window_size[0], shift_size[0]):
        for ws in _shift_slices(window_size[1], shift_size[1]):
            region[:, hs, ws, :] = label
            label += 1
    windows = window_partition(region, window_size).squeeze(-1)     # (nW, N)
    different = windows.unsqueeze(1) != windows.unsqueeze(2)          # (nW, N, N)
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill_(
        different, MASKED_LOGIT)


def _shift_slices(window: int, shift: int) -> Tuple[slice, slice, slice]:
    return slice(0, -window), slice(-window, -shift), slice(-shift, None)
