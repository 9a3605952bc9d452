"""Swin window attention: the shared :class:`Attention` plus a relative-position bias table."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ...functional import (SizeCache, attend, bias_table_size, relative_position_index,
                           window_bias)
from .attention import Attention

#: Flattened relative-position indices per (window, device); a function of sizes alone.
_INDEX: SizeCache[Tensor] = SizeCache()


class WindowedAttention(Attention):
    """Attention within windows, as Swin V1 and V2 share it: subclasses give the terms of the
    logits (:meth:`window_logit_terms`); this class splits the heads, folds the windows into
    the heads under a shift mask and runs the attention."""

    def window_logit_terms(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``q, k`` ``(B * nW, heads, N, d)`` -> ``(q', k', bias)``: the logits are
        ``q' k'^T * scale + bias``, ``bias`` ``(1, heads, N, N)``."""
        raise NotImplementedError

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``x``: windows ``(B * nW, N, C)``; ``mask``: ``(nW, N, N)`` shift mask or None."""
        return self.project_out(self.attend_windows(self.project_qkv(x), mask))

    def attend_windows(self, qkv: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Attention of projected windows ``qkv`` ``(B * nW, N, 3C)`` -> ``(B * nW, N, C)``
        (before ``proj``); ``mask``: ``(nW, N, N)`` shift mask or None."""
        q, k, v, bias = self.window_heads(qkv, mask)
        out = attend(q, k, v, window_bias(bias, mask), self.dropout_p, self.fused,
                     self.scale)                                     # as q
        return self.merge_window_heads(out, qkv.shape[0])

    def window_heads(self, qkv: Tensor, mask: Optional[Tensor]
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``qkv`` ``(B * nW, N, 3C)`` -> ``q, k, v`` and the ``(1, heads, N, N)`` bias.

        Without a mask ``q, k, v`` are ``(B * nW, heads, N, d)``; with one, the windows are
        folded into the heads, ``(B, nW * heads, N, d)``, so that the bias + mask of one image
        broadcasts over the batch (:func:`~vitdet_plugin.functional.window_bias`)."""
        bw, n, _ = qkv.shape
        q, k, v = self.split_heads(qkv)                              # (B * nW, heads, N, d)
        q, k, bias = self.window_logit_terms(q, k)                   # bias (1, heads, N, N)
        if mask is not None:
            nw = mask.shape[0]
            q, k, v = (t.reshape(bw // nw, nw * self.num_heads, n, self.head_dim)
                       for t in (q, k, v))                           # (B, nW * heads, N, d)
        return q, k, v, bias

    def merge_window_heads(self, out: Tensor, windows: int) -> Tensor:
        """The attention output of :meth:`window_heads`' layout -> ``(B * nW, N, C)``."""
        n = out.shape[-2]
        out = out.reshape(windows, self.num_heads, n, self.head_dim)  # (B * nW, heads, N, d)
        return out.transpose(1, 2).reshape(windows, n, self.dim)


class WindowAttention(WindowedAttention):
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
        self.window_size: Tuple[int, int] = (int(window_size[0]), int(window_size[1]))
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros(int(math.prod(bias_table_size(self.window_size))), num_heads))

    @property
    def window_tokens(self) -> int:
        return self.window_size[0] * self.window_size[1]

    def relative_position_bias(self) -> Tensor:
        """The ``(1, heads, N, N)`` bias of one window, gathered from the table."""
        n, table = self.window_tokens, self.relative_position_bias_table
        # the index is derived from window_size per device (not a buffer: a model built on
        # the meta device and materialised with to_empty() would index with garbage)
        index = _INDEX.get((self.window_size, table.device), lambda: relative_position_index(
            self.window_size).view(-1).to(table.device))
        return table[index].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)

    def window_logit_terms(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``q``, ``k`` as they are (``scale`` is ``head_dim ** -0.5`` or ``qk_scale``) and the
        relative-position bias."""
        return q, k, self.relative_position_bias()

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}, ' + super().extra_repr()
