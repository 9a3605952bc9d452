"""What Swin V1 and V2 window attention share: heads split, windows folded under a shift mask.

Swin V2's :class:`~.cosine_window_attention.CosineWindowAttention` runs through it, and so do
the accel runners (for V1's ``backbones.swin.WindowAttention`` too, whose own forward is
written out in one method)."""
from typing import Optional, Tuple

from torch import Tensor

from ...functional import attend, window_bias
from .attention import Attention


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
