"""Swin Transformer V2 backbone with detection semantics.

Swin V2 (Liu et al. 2022) keeps V1's hierarchy of (shifted) window attention stages and
changes three things: residual post-norm (``x = x + norm(attn(x))``, ``x = x + norm(mlp(x))``;
huge / giant add a norm every 6 blocks), scaled cosine attention with a learned per-head logit
scale, and a continuous position bias computed by a small MLP from log-spaced relative
coordinates (so windows can grow at fine-tuning without resizing any table); patch merging
reduces first and normalises ``2C`` after.

Detection semantics as our V1 :class:`~.swin.SwinBackbone` (and mmpretrain with
``pad_small_map=True``): any input size, zero padding at the bottom/right, shifted blocks always
shift. ``pad_small_map=False`` reproduces mmpretrain's classification default instead.

Parameter names follow the official Microsoft layout (``layers.{i}.blocks.{j}...``, downsample
at the end of stage ``i``); timm and mmpretrain layouts are converted by
:mod:`vitdet_plugin.weights.swin_v2`.
"""
import dataclasses
import numbers
from functools import partial
from typing import ClassVar, Optional, Sequence, Tuple, Union

from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from torch import Tensor, nn

from ...functional import from_windows, stage_windows, to_windows
from ...functional.sizes import Window, WindowArg
from ...functional.checkpoint_target import CheckpointTarget
from ..layers import DropPath, Mlp, PatchMerging
from ..layers.cosine_window_attention import LOGIT_SCALE_INIT, CosineWindowAttention
from .archs import SwinArch
from .base import (init_cfg_from_pretrained, init_transformer_weights_, load_init_checkpoint,
                   state_shapes)
from .hierarchical import WindowBackbone


@dataclasses.dataclass(frozen=True)
class SwinV2Arch(SwinArch):
    """:class:`SwinArch` plus ``extra_norm_every_n_blocks`` (huge / giant: 6)."""

    extra_norm_every_n_blocks: int = 0

    NAME: ClassVar[str] = 'Swin V2'
    PRESETS: ClassVar = {
        **SwinArch.PRESETS,
        # mmpretrain's presets; its source notes the head counts are not certain
        'huge': dict(embed_dims=352, depths=(2, 2, 18, 2), num_heads=(8, 16, 32, 64),
                     extra_norm_every_n_blocks=6),
        'giant': dict(embed_dims=512, depths=(2, 2, 42, 4), num_heads=(16, 32, 64, 128),
                      extra_norm_every_n_blocks=6),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.extra_norm_every_n_blocks
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
            raise ValueError(f'extra_norm_every_n_blocks must be an int >= 0 (0: none), got {n!r}')


class SwinV2Block(nn.Module):
    """One Swin V2 block on ``(B, H, W, C)``: post-norm cosine window attention, then MLP.

    Args:
        dim, num_heads, window_size, pretrained_window_size: see
            :class:`~..layers.cosine_window_attention.CosineWindowAttention`.
        shift: shift the windows by half a window (SW-MSA).
        pad_small_map: see :class:`SwinV2Backbone`.
        extra_norm: a final norm after the block (``norm3``; huge / giant models).
    """

    def __init__(self, dim: int, num_heads: int, window_size: Window,
                 pretrained_window_size: Window, shift: bool, pad_small_map: bool = True,
                 extra_norm: bool = False, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 norm_cfg: Optional[dict] = None, act_cfg: Optional[dict] = None) -> None:
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN')
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.pad_small_map = pad_small_map
        self.attn = CosineWindowAttention(dim, num_heads, window_size, pretrained_window_size,
                                          qkv_bias, attn_drop, drop)
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop)
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.norm3 = build_norm_layer(norm_cfg, dim)[1] if extra_norm else None

    def shift_for(self, hw: Tuple[int, int]) -> Window:
        """The shift on an ``H x W`` map: always (detection), or mmpretrain's classification
        rule without ``pad_small_map`` (none when a side equals its window)."""
        if not self.pad_small_map:
            if any(s < w for s, w in zip(hw, self.window_size)):
                raise ValueError(
                    f'a {hw[0]}x{hw[1]} feature map is smaller than the {self.window_size[0]}x'
                    f'{self.window_size[1]} window, which pad_small_map=False does not allow; '
                    'set pad_small_map=True (pad and shift, the detection semantics) or use a '
                    'smaller window_size / larger input')
            if any(s == w for s, w in zip(hw, self.window_size)):
                return (0, 0)
        return self.shift_size

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``: residual post-norm attention, then MLP."""
        shift = self.shift_for((x.shape[1], x.shape[2]))
        windows, grid = to_windows(x, self.window_size, shift)       # (B * nW, N, C)
        windows = self.attn(windows, grid.shift_mask(x.device, x.dtype))  # (B * nW, N, C)
        x = x + self.drop_path(self.norm1(from_windows(windows, grid)))  # (B, H, W, C)
        x = x + self.drop_path(self.norm2(self.mlp(x)))
        return self.norm3(x) if self.norm3 is not None else x


@MODELS.register_module()
class SwinV2Backbone(WindowBackbone):
    """Swin Transformer V2 for detection: multi-scale NCHW maps with a declared contract.

    Args:
        arch: preset (``'tiny'``, ``'small'``, ``'base'``, ``'large'``, ``'huge'``,
            ``'giant'``) or a dict with ``embed_dims``, ``depths``, ``num_heads`` (and
            ``extra_norm_every_n_blocks``); those given directly override it.
        window_size: an int, an ``(h, w)`` pair, or one of those per stage (e.g.
            ``(16, 16, 16, 8)``); a pair of ints is always one ``(h, w)`` window, as in timm.
        pretrained_window_sizes: per stage, the window the checkpoint was pretrained with:
            relative offsets are normalised by it, so a window-8/12 checkpoint runs with larger
            windows (published fine-tunes: ``(12, 12, 12, 6)``); an int for all stages; 0: the
            stage's own window (default).
        pad_small_map: True (default): detection semantics (pad to whole windows, shifted
            blocks always shift). False: mmpretrain's ``pad_small_map=False`` (no shift in a
            stage whose map has a side equal to its window; a smaller map is an error).
        mlp_ratio, qkv_bias: block settings (``qkv_bias``: ``q_bias`` and ``v_bias``).
        drop_rate, attn_drop_rate, drop_path_rate: as :class:`~.swin.SwinBackbone`.
        patch_norm: LayerNorm after the patch embedding (patch merging always has its norm).
        out_indices, frozen_stages, norm_eval, with_cp, fused_attn, accel, norm_cfg,
            act_cfg, in_channels, patch_size: as :class:`~.swin.SwinBackbone`.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads official, timm,
            mmpretrain or our own Swin V2 checkpoints (format detected, weights_only; optional
            ``prefix``).
    """

    #: No weight decay (besides norms and biases): the logit scales and the q / v biases.
    NO_DECAY_PARAMS = ('logit_scale', 'q_bias', 'v_bias', 'cpb_mlp')

    def __init__(self,
                 arch: Union[str, dict, None] = 'tiny',
                 embed_dims: Optional[int] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 in_channels: int = 3,
                 patch_size: int = 4,
                 window_size: WindowArg = 8,
                 pretrained_window_sizes: WindowArg = 0,
                 pad_small_map: bool = True,
                 mlp_ratio: float = 4.0,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1,
                 patch_norm: bool = True,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 fused_attn: bool = True,
                 accel: str = 'auto',
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        init_cfg = init_cfg_from_pretrained(pretrained, init_cfg)
        spec = SwinV2Arch.resolve(arch, embed_dims=embed_dims, depths=depths,
                                  num_heads=num_heads)
        num_stages = len(spec.depths)
        self.window_sizes = stage_windows(window_size, num_stages, 'window_size', 1)
        self.pretrained_window_sizes = stage_windows(
            pretrained_window_sizes, num_stages, 'pretrained_window_sizes', 0,
            pair_for_all=False)
        self._extra_norm_every = spec.extra_norm_every_n_blocks
        self._block = partial(SwinV2Block, pad_small_map=pad_small_map, mlp_ratio=mlp_ratio,
                              qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate,
                              norm_cfg=norm_cfg or dict(type='LN'), act_cfg=act_cfg)
        super().__init__(
            spec, in_channels=in_channels, patch_size=patch_size, out_indices=out_indices,
            frozen_stages=frozen_stages, mlp_ratio=mlp_ratio, drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate, patch_norm=patch_norm,
            norm_eval=norm_eval, with_cp=with_cp, fused_attn=fused_attn, accel=accel,
            norm_cfg=norm_cfg, init_cfg=init_cfg, qkv_bias=qkv_bias, pad_small_map=pad_small_map)

    def make_block(self, stage: int, index: int, dim: int, num_heads: int,
                   drop_path: float) -> nn.Module:
        """W-MSA and SW-MSA blocks in turn; a final norm every ``extra_norm_every_n_blocks``."""
        every = self._extra_norm_every
        return self._block(dim, num_heads, self.window_sizes[stage],
                           self.pretrained_window_sizes[stage], shift=index % 2 == 1,
                           extra_norm=bool(every) and (index + 1) % every == 0,
                           drop_path=drop_path)

    def make_merge(self, dim: int, norm_cfg: dict) -> nn.Module:
        """Concat 2x2 -> linear ``4C -> 2C`` -> norm (post-norm)."""
        return PatchMerging(dim, build_norm_layer(norm_cfg, 2 * dim)[1], post_norm=True)

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a Swin V2 checkpoint for: per stage, the window
        relative offsets are normalised by (the pretrained one, else its own)."""
        windows = tuple((p[0] or w[0], p[1] or w[1])
                        for p, w in zip(self.pretrained_window_sizes, self.window_sizes))
        return CheckpointTarget('Swin V2', type(self).__name__, state_shapes(self),
                                out_indices=self.out_indices, pretrained_windows=windows,
                                arch_presets=SwinV2Arch.PRESETS)

    def init_weights(self) -> None:
        """Load ``init_cfg.checkpoint`` through the converters, or initialise as the official
        code: truncated-normal linears, ``logit_scale = log(10)``, zero q / v biases, and the
        blocks' post-norms at zero (each block starts as the identity)."""
        if load_init_checkpoint(self):
            return
        init_transformer_weights_(self)
        for m in self.modules():
            if isinstance(m, CosineWindowAttention):
                nn.init.constant_(m.logit_scale, LOGIT_SCALE_INIT)
                for bias in (m.q_bias, m.v_bias):
                    if bias is not None:
                        nn.init.zeros_(bias)
        for m in self.modules():
            if isinstance(m, SwinV2Block):  # residual post-norm init (official, timm)
                for norm in (m.norm1, m.norm2):
                    if isinstance(norm, nn.LayerNorm):
                        nn.init.zeros_(norm.weight)
                        nn.init.zeros_(norm.bias)
        self._is_init = True
