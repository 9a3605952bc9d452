"""ViTDet / SAM decomposed relative positions: per-axis tables (``rel_pos_h``, ``rel_pos_w``)
whose embeddings are dotted with the queries, giving a ``(B, heads, N, N)`` bias that depends
on the input; or, without ever forming that bias, extra query / key channels
(:func:`decomposed_rel_pos_channels`)."""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .pos_grid import interpolation_dtype
from .sizes import SizeCache, known_equal

#: Head dims handed to the fused attention kernels are padded to a multiple of this (the
#: alignment CUDA's memory-efficient and flash kernels want; zeros change no dot product).
HEAD_DIM_ALIGN = 8

_ONE_HOT_KEYS: SizeCache[Tensor] = SizeCache()


def resize_rel_pos(rel_pos: Tensor, length: int) -> Tensor:
    """Linearly resize a ``(L, C)`` decomposed relative-position table to ``(length, C)``."""
    if known_equal(rel_pos.shape[0], length):  # a symbolic length resizes (maybe to itself)
        return rel_pos
    resized = F.interpolate(interpolation_dtype(rel_pos).t()[None], size=length, mode='linear')
    return resized[0].t().to(rel_pos.dtype)


def decomposed_rel_pos_embeddings(q_size: int, k_size: int, rel_pos: Tensor) -> Tensor:
    """Per-pair embeddings ``(q_size, k_size, C)`` for one axis of decomposed relative positions.

    The table covers ``2 * max(q_size, k_size) - 1`` offsets and is linearly resized when it
    was trained for another size; coordinates are scaled when query and key sizes differ.
    """
    max_dist = 2 * max(q_size, k_size) - 1
    table = resize_rel_pos(rel_pos, max_dist)
    if known_equal(q_size, k_size):  # self-attention: integer offsets, no (symbolic) float scale
        coords = torch.arange(q_size, device=rel_pos.device)
        return table[coords[:, None] - coords[None, :] + (k_size - 1)]
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    rel = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return table[rel.long()]


def decomposed_rel_pos_terms(q: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor,
                             q_size: Tuple[int, int],
                             k_size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """The two per-axis terms of :func:`decomposed_rel_pos_bias`:
    ``(B, heads, qh, qw, kh)`` and ``(B, heads, qh, qw, kw)`` (the bias is their broadcast sum).
    """
    qh, qw = q_size
    kh, kw = k_size
    rh = decomposed_rel_pos_embeddings(qh, kh, rel_pos_h)     # (qh, kh, d)
    rw = decomposed_rel_pos_embeddings(qw, kw, rel_pos_w)     # (qw, kw, d)
    b, heads, _, d = q.shape
    r_q = q.reshape(b, heads, qh, qw, d)
    rel_h = torch.einsum('bnhwc,hkc->bnhwk', r_q, rh.to(q.dtype))
    rel_w = torch.einsum('bnhwc,wkc->bnhwk', r_q, rw.to(q.dtype))
    return rel_h, rel_w


def decomposed_rel_pos_bias(q: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor,
                            q_size: Tuple[int, int], k_size: Tuple[int, int]) -> Tensor:
    """Additive attention bias from decomposed relative positions (MViTv2 / ViTDet / SAM).

    Args:
        q: queries ``(B, heads, qh * qw, head_dim)`` (unscaled).
        rel_pos_h, rel_pos_w: per-axis tables ``(L, head_dim)``.
        q_size, k_size: query and key grids ``(h, w)``.

    Returns:
        bias ``(B, heads, qh * qw, kh * kw)``.
    """
    rel_h, rel_w = decomposed_rel_pos_terms(q, rel_pos_h, rel_pos_w, q_size, k_size)
    bias = rel_h[..., :, None] + rel_w[..., None, :]             # (B, heads, qh, qw, kh, kw)
    b, heads = q.shape[:2]
    return bias.reshape(b, heads, q_size[0] * q_size[1], k_size[0] * k_size[1])


def _one_hot_key_channels(k_size: Tuple[int, int], width: int, device: torch.device,
                          dtype: torch.dtype) -> Tensor:
    """``(kh * kw, width)``: for key ``(i, j)`` a one at column ``i`` and at ``kh + j``, zeros
    elsewhere (cached per size, device and dtype)."""
    def build() -> Tensor:
        kh, kw = k_size
        rows = torch.arange(kh * kw, device=device)
        keys = torch.zeros(kh * kw, width, device=device, dtype=dtype)
        keys[rows, rows // kw] = 1
        keys[rows, kh + rows % kw] = 1
        return keys
    return _ONE_HOT_KEYS.get((tuple(k_size), width, device, dtype), build)


def decomposed_rel_pos_channels(q: Tensor, k: Tensor, v: Tensor, rel_pos_h: Tensor,
                                rel_pos_w: Tensor, size: Tuple[int, int],
                                scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Inputs for ``F.scaled_dot_product_attention(q', k', v', scale=1)`` that give attention
    with the decomposed relative-position bias, without forming the ``(N, N)`` bias.

    The bias ``rel_h[q, k_h] + rel_w[q, k_w]`` is a dot product of the query's terms with the
    one-hot key coordinates, so it rides along as extra channels::

        q' = [q * scale, rel_h(q), rel_w(q)]      (B, heads, N, d + kh + kw) -> padded
        k' = [k,         onehot(k_h), onehot(k_w)]
        v' = [v, 0]                               (same width: the fused kernels want it)

    The fused kernel then needs no ``attn_mask`` (so it keeps only its output and log-sum-exp
    for backward, on every device), and the gradient reaches ``rel_pos_h`` / ``rel_pos_w``
    through ``q'``. The attention output is ``out[..., :d]``.

    Args:
        q, k, v: ``(B, heads, N, d)`` with ``N = h * w`` tokens of a ``size = (h, w)`` grid.
        rel_pos_h, rel_pos_w: per-axis tables ``(L, d)``.
        scale: the logit scale of ``q k^T``.
    """
    h, w = size
    rel_h, rel_w = decomposed_rel_pos_terms(q, rel_pos_h, rel_pos_w, size, size)
    b, heads, n, d = q.shape
    width = d + h + w
    width += (-width) % HEAD_DIM_ALIGN
    pad = width - (d + h + w)
    q = torch.cat([q * scale, rel_h.reshape(b, heads, n, h), rel_w.reshape(b, heads, n, w),
                   q.new_zeros(b, heads, n, pad)], dim=-1)          # (B, heads, N, width)
    keys = _one_hot_key_channels(size, width - d, k.device, k.dtype)  # (N, width - d)
    k = torch.cat([k, keys.expand(b, heads, n, width - d)], dim=-1)   # (B, heads, N, width)
    v = F.pad(v, (0, width - d))                                     # (B, heads, N, width)
    return q, k, v
