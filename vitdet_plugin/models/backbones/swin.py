"""Swin Transformer backbone with detection semantics (Swin-Transformer-Object-Detection / mmdet).

Patch partition + linear embedding, stages of alternating W-MSA / SW-MSA blocks with a
relative-position bias and the shifted-window mask, patch merging between stages, and a
LayerNorm per output. Any input size works: the image is padded to the patch size and each
block pads its input to the window size (zeros at the bottom/right), so an ``H x W`` input gives
stride-``s`` maps of ``ceil(H / s) x ceil(W / s)``.

Parameter names follow the official Microsoft layout (``layers.{i}.blocks.{j}...``, downsample
at the end of stage ``i``), so official checkpoints load without renaming; other layouts are
converted by :mod:`vitdet_plugin.weights.swin`.

This file holds the block and what is Swin V1's own; the stages, embedding, output norms and
freezing are :class:`~.hierarchical.WindowBackbone`'s. On the CPU, ``accel='auto'`` runs the
stages through :mod:`..accel`'s runners (chunked in-place inference, recomputing backwards).
"""
import math
import numbers
from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...functional import (ArgumentError, SizeCache, attend, bias_table_size, from_windows,
                           relative_position_index, to_windows, window_pair)
from ...weights.target import CheckpointTarget
from ..accel import StageRunner, plan_for_tensor, swin_runner
from ..layers import DropPath, Mlp, PatchMerging
from ..layers.window_attention import WindowedAttention
from .archs import SWIN_ARCHS, SwinArch  # noqa: F401  (SWIN_ARCHS: re-exported)
from .base import (TRUNC_NORMAL_STD, init_cfg_from_pretrained, init_transformer_weights_,
                   load_init_checkpoint, state_shapes)
from .hierarchical import WindowBackbone

if TYPE_CHECKING:  # the block has what the accel runners read (mypy checks it here)
    from ..accel.protocols import SwinBlockParts

#: Flattened relative-position indices per (window, device); a function of sizes alone.
_INDEX: SizeCache[Tensor] = SizeCache()


class WindowAttention(WindowedAttention):
    """Multi-head attention inside ``wh x ww`` windows with a learned relative-position bias.

    Its :meth:`forward` is the whole plain path in one method; the accel runners use the
    :class:`~..layers.window_attention.WindowedAttention` steps (``window_heads``, ...), which
    compute the same.

    Args:
        dim: token channels.
        num_heads: attention heads.
        window_size: ``(wh, ww)``.
        qkv_bias, attn_drop, proj_drop, fused: see :class:`~..layers.Attention`.
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

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``x``: windows ``(B * nW, N, C)``; ``mask``: ``(nW, N, N)`` shift mask or None.

        ``softmax(q k^T * scale + bias (+ mask)) v``, then ``proj``."""
        bw, n, c = x.shape
        heads, d = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(bw, n, 3, heads, d)                   # (B * nW, N, 3, heads, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)               # (B * nW, heads, N, d)
        bias = self.relative_position_bias()                         # (1, heads, N, N)
        if mask is not None:
            # windows folded into the heads: one image's bias + mask broadcasts over the batch
            nw = mask.shape[0]
            q, k, v = (t.reshape(bw // nw, nw * heads, n, d)
                       for t in (q, k, v))                           # (B, nW * heads, N, d)
            bias = (bias + mask.unsqueeze(1)).reshape(1, nw * heads, n, n)  # (1, nW*heads, N, N)
        dropout_p = self.attn_drop if self.training else 0.0
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype),
                                                 dropout_p=dropout_p, scale=self.scale)
        else:  # the explicit formula: the reference of the parity tests
            out = attend(q, k, v, bias, dropout_p, fused=False, scale=self.scale)  # as q
        out = out.reshape(bw, heads, n, d).transpose(1, 2)           # (B * nW, N, heads, d)
        return self.proj_drop(self.proj(out.reshape(bw, n, c)))      # (B * nW, N, C)

    def relative_position_bias(self) -> Tensor:
        """The ``(1, heads, N, N)`` bias of one window, gathered from the table."""
        n, table = self.window_size[0] * self.window_size[1], self.relative_position_bias_table
        # the index is derived from window_size per device (not a buffer: a model built on
        # the meta device and materialised with to_empty() would index with garbage)
        index = _INDEX.get((self.window_size, table.device), lambda: relative_position_index(
            self.window_size).view(-1).to(table.device))
        return table[index].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)  # (1, heads, N, N)

    def window_logit_terms(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """For the accel runners' ``window_heads``: ``q``, ``k`` as they are (``scale`` is
        ``head_dim ** -0.5`` or ``qk_scale``) and the relative-position bias."""
        return q, k, self.relative_position_bias()

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}, ' + super().extra_repr()


class SwinBlock(nn.Module):
    """One Swin block on ``(B, H, W, C)``: (shifted) window attention, then an MLP.

    Args:
        dim, num_heads: channels and attention heads.
        window_size: ``(wh, ww)``.
        shift: shift the windows by half a window (SW-MSA) instead of W-MSA.
        mlp_ratio: MLP hidden width / ``dim``.
        qkv_bias, qk_scale, attn_drop: see :class:`WindowAttention`.
        drop: dropout after the projections.
        drop_path: stochastic-depth rate of this block.
        norm_cfg, act_cfg: mmcv config dicts for the norms and the MLP activation.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int], shift: bool,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None) -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.norm1 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        self.attn = WindowAttention(dim, num_heads, window_size, qkv_bias, qk_scale, attn_drop,
                                    drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop)

    @property
    def shifted(self) -> bool:
        return any(self.shift_size)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        # pad to whole windows, roll by -shift (SW-MSA), partition: (B * nW, N, C)
        windows, grid = to_windows(self.norm1(x), self.window_size, self.shift_size)
        windows = self.attn(windows, grid.shift_mask(x.device, x.dtype))  # (B * nW, N, C)
        x = x + self.drop_path(from_windows(windows, grid))          # (B, H, W, C)
        return x + self.drop_path(self.mlp(self.norm2(x)))


if TYPE_CHECKING:
    _SWIN_BLOCK: Type[SwinBlockParts] = SwinBlock


@MODELS.register_module()
class SwinBackbone(WindowBackbone):
    """Swin Transformer for detection: multi-scale NCHW maps with a declared contract.

    Args:
        arch: preset (``'tiny'``, ``'small'``, ``'base'``, ``'large'``) or a dict with
            ``embed_dims``, ``depths``, ``num_heads``; those given directly override it.
        in_channels: image channels.
        patch_size: patch embedding stride (the first output stride).
        window_size: attention window, int or ``(wh, ww)``.
        mlp_ratio, qkv_bias, qk_scale: block settings (``qk_scale`` overrides
            ``head_dim ** -0.5``; None or 0: the default).
        drop_rate, attn_drop_rate: dropout after projections / on attention weights.
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks.
        use_abs_pos_embed: add an absolute position embedding stored at the pretraining
            grid (``pretrain_img_size / patch_size``) and bicubically resized to the input.
        pretrain_img_size: image size of that grid (int or ``(h, w)``).
        patch_norm: LayerNorm after the patch embedding and in patch merging.
        stem_channels: optional convolutional stem (:class:`~..layers.ConvStem`, one ``3x3``
            stride-2 conv + norm + ReLU per entry) before a patch projection covering the rest
            of ``patch_size``; for training from scratch (no published weights).
        stem_norm_cfg: norm config of the stem's convolutions (default BN).
        out_indices: stages whose outputs are returned (each through its own norm).
        frozen_stages: ``-1`` trains everything; ``0`` freezes the patch embedding (and the
            absolute position embedding); ``k >= 1`` also stages ``0..k-1`` and their output
            norms (``requires_grad=False``, kept in eval mode).
        norm_eval: keep every norm layer in eval mode during training.
        with_cp: activation checkpointing per block (non-reentrant).
        fused_attn: deprecated; False warns and switches the attention to the eager formula
            (:func:`~..layers.eager_attention` is the way to do that).
        accel: ``'auto'`` (default) uses our CPU kernels on the CPU and the plain path
            elsewhere; ``'off'`` the plain path everywhere (see :mod:`..accel`).
        norm_cfg, act_cfg: mmcv config dicts.
        strides: accepted for mmdet-config compatibility; must equal ``(patch_size, 2, ...)``.
        convert_weights: accepted for mmdet-config compatibility (formats are detected).
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads official, Swin detection,
            timm, mmdet/mmpretrain or our own checkpoints (format detected, weights_only; a
            path, ``~`` path or http(s) URL; optional ``prefix`` and, for a checkpoint with a
            rectangular window, ``src_window_size=(h, w)``).
    """

    NO_DECAY_PARAMS = ('absolute_pos_embed', 'relative_position_bias_table')

    def __init__(self,
                 arch: Union[str, dict, None] = 'tiny',
                 embed_dims: Optional[int] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 in_channels: int = 3,
                 patch_size: int = 4,
                 window_size: Union[int, Tuple[int, int]] = 7,
                 mlp_ratio: float = 4.0,
                 qkv_bias: bool = True,
                 qk_scale: Optional[float] = None,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1,
                 use_abs_pos_embed: bool = False,
                 pretrain_img_size: Union[int, Tuple[int, int]] = 224,
                 patch_norm: bool = True,
                 stem_channels: Sequence[int] = (),
                 stem_norm_cfg: Optional[dict] = None,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 fused_attn: bool = True,
                 accel: str = 'auto',
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 strides: Optional[Sequence[int]] = None,
                 convert_weights: bool = True,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        init_cfg = init_cfg_from_pretrained(pretrained, init_cfg)
        spec = SwinArch.resolve(arch, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        self.window_size = window_pair(window_size, 'window_size')
        expected_strides = (patch_size,) + (2,) * (len(spec.depths) - 1)
        if strides is not None and tuple(strides) != expected_strides:
            raise ArgumentError(f'strides={tuple(strides)} is not supported: Swin uses the '
                                f'patch size then 2x patch merging, i.e. {expected_strides}')
        if qk_scale is not None and (not isinstance(qk_scale, numbers.Real) or qk_scale < 0):
            raise ValueError(f'qk_scale must be None or a non-negative number (0: the default '
                             f'head_dim ** -0.5), got {qk_scale!r}')
        self.convert_weights = convert_weights
        self._merge_norm = patch_norm
        self._block = partial(SwinBlock, window_size=self.window_size, mlp_ratio=mlp_ratio,
                              qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop_rate,
                              attn_drop=attn_drop_rate, norm_cfg=norm_cfg or dict(type='LN'),
                              act_cfg=act_cfg)
        super().__init__(
            spec, in_channels=in_channels, patch_size=patch_size, out_indices=out_indices,
            frozen_stages=frozen_stages, mlp_ratio=mlp_ratio, drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate, patch_norm=patch_norm,
            norm_eval=norm_eval, with_cp=with_cp, fused_attn=fused_attn, accel=accel,
            norm_cfg=norm_cfg, stem_channels=stem_channels, stem_norm_cfg=stem_norm_cfg,
            use_abs_pos_embed=use_abs_pos_embed, pretrain_img_size=pretrain_img_size,
            init_cfg=init_cfg, qkv_bias=qkv_bias, convert_weights=convert_weights)

    def make_block(self, stage: int, index: int, dim: int, num_heads: int,
                   drop_path: float) -> nn.Module:
        """W-MSA and SW-MSA blocks in turn."""
        return self._block(dim, num_heads, shift=index % 2 == 1, drop_path=drop_path)

    def make_merge(self, dim: int, norm_cfg: dict) -> nn.Module:
        """Concat 2x2 -> norm (with ``patch_norm``) -> linear ``4C -> 2C``."""
        norm = build_norm_layer(norm_cfg, 4 * dim)[1] if self._merge_norm else nn.Identity()
        return PatchMerging(dim, norm)

    def stage_runner(self, x: Tensor) -> Optional[StageRunner]:
        return swin_runner(plan_for_tensor(x, self.accel), self.training)

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a Swin checkpoint for."""
        pos = self.absolute_pos_embed.shape[-2:] if self.use_abs_pos_embed else None
        return CheckpointTarget('Swin', type(self).__name__, state_shapes(self),
                                window_size=self.window_size, out_indices=self.out_indices,
                                pos_grid=(pos[0], pos[1]) if pos is not None else None)

    def init_weights(self) -> None:
        """Truncated-normal init, or load ``init_cfg.checkpoint`` through the layout table."""
        if load_init_checkpoint(self, 'src_window_size'):
            return
        if self.use_abs_pos_embed:
            trunc_normal_(self.absolute_pos_embed, std=TRUNC_NORMAL_STD)
        init_transformer_weights_(self)
        for m in self.modules():
            if isinstance(m, WindowAttention):
                trunc_normal_(m.relative_position_bias_table, std=TRUNC_NORMAL_STD)
        self._is_init = True
