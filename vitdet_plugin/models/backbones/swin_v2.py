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
from typing import ClassVar, List, Optional, Sequence, Tuple, Union

from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...weights.swin_v2 import load_swin_v2_pretrained
from ..accel import check_accel, padding_free_window_attention, plan_for_tensor
from ..layers import (DropPath, Mlp, PatchEmbed, PatchMerging, check_flag, check_rate,
                      int_tuple, linear_drop_path_rates, positive_int)
from ..layers.cosine_window_attention import LOGIT_SCALE_INIT, CosineWindowAttention
from ..layers.shifted_windows import shifted_window_attention
from .archs import SwinArch
from .base import (BackboneContract, init_cfg_from_pretrained, init_transformer_weights_,
                   pretrained_init_cfg)
from .swin import SwinBackbone, WindowStage

#: A window: an int (square) or ``(h, w)``; per stage: one of those, or a sequence of them.
WindowArg = Union[int, Sequence[int], Sequence[Union[int, Sequence[int]]]]
Window = Tuple[int, int]


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


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _pair(value: object) -> Optional[Window]:
    """``7 -> (7, 7)``, ``(7, 9) -> (7, 9)``, anything else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value), int(value))
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_is_int, value)):
        return (int(value[0]), int(value[1]))
    return None


def stage_windows(value: WindowArg, num_stages: int, name: str, minimum: int,
                  pair_for_all: bool = True) -> Tuple[Window, ...]:
    """One ``(h, w)`` per stage from an int, one int / ``(h, w)`` per stage, or (with
    ``pair_for_all``) a pair of ints: one ``(h, w)`` for all stages, as in timm."""
    windows: List[Optional[Window]] = [_pair(value)] * num_stages
    if isinstance(value, (tuple, list)):
        one_pair = pair_for_all and len(value) == 2 and all(map(_is_int, value))
        if not one_pair:
            windows = [_pair(v) for v in value] if len(value) == num_stages else [None]
    found = [w for w in windows if w is not None]
    if len(found) != num_stages:
        form = 'an int or a pair (h, w), or' if pair_for_all else 'an int or'
        raise ValueError(f'{name} must be {form} one int or (h, w) pair per stage (the model '
                         f'has {num_stages} stages), got {value!r}')
    if any(min(w) < minimum for w in found):
        bound = 'positive' if minimum > 0 else f'>= {minimum} (0: the stage\'s own window)'
        raise ValueError(f'{name} must be {bound}, got {value!r}')
    return tuple(found)


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
                 norm_cfg: Optional[dict] = None, act_cfg: Optional[dict] = None,
                 fused_attn: bool = True, accel: str = 'off') -> None:
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN')
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.pad_small_map = pad_small_map
        self.attn = CosineWindowAttention(dim, num_heads, window_size, pretrained_window_size,
                                          qkv_bias, attn_drop, drop, fused_attn, accel)
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop, accel=accel)
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
        shift = self.shift_for((x.shape[1], x.shape[2]))
        attention = (padding_free_window_attention  # see accel.padding_free
                     if plan_for_tensor(x, self.attn.accel).compiled else shifted_window_attention)
        out = attention(x, self.attn, self.window_size, shift,
                        self.attn.logit_scale.dtype)                 # (B, H, W, C)
        x = x + self.drop_path(self.norm1(out))
        x = x + self.drop_path(self.norm2(self.mlp(x)))
        return self.norm3(x) if self.norm3 is not None else x


class SwinV2Stage(WindowStage):
    """``depth`` blocks alternating W-MSA / SW-MSA, then optional (post-norm) patch merging."""

    def __init__(self, dim: int, depth: int, num_heads: int, window_size: Window,
                 drop_paths: Sequence[float], downsample: bool, norm_cfg: dict,
                 with_cp: bool = False, extra_norm_every_n_blocks: int = 0,
                 **block_kwargs) -> None:
        super().__init__()
        self.with_cp = with_cp
        every = extra_norm_every_n_blocks
        self.blocks = nn.ModuleList([
            SwinV2Block(dim, num_heads, window_size, shift=(j % 2 == 1),
                        extra_norm=bool(every) and (j + 1) % every == 0,
                        drop_path=drop_paths[j], norm_cfg=norm_cfg, **block_kwargs)
            for j in range(depth)])
        self.downsample = PatchMerging(dim, build_norm_layer(norm_cfg, 2 * dim)[1],
                                       post_norm=True) if downsample else None


@MODELS.register_module()
class SwinV2Backbone(BackboneContract, BaseModule):
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

    depths: Tuple[int, ...]
    out_indices: Tuple[int, ...]
    patch_embed: PatchEmbed
    drop_after_pos: nn.Module
    layers: nn.ModuleList

    # the same rules and attribute names as V1 (layers.{i}.blocks.{j}, downsample at the end)
    layer_id = SwinBackbone.layer_id
    frozen_modules = SwinBackbone.frozen_modules

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
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        spec = SwinV2Arch.resolve(arch, embed_dims=embed_dims, depths=depths,
                                  num_heads=num_heads)
        self.embed_dims, self.depths, self.num_heads = spec.embed_dims, spec.depths, spec.num_heads
        num_stages = len(self.depths)
        dims = [self.embed_dims * 2**i for i in range(num_stages)]
        self.in_channels = positive_int(in_channels, 'in_channels')
        positive_int(patch_size, 'patch_size', ' (the first output stride)')
        self.window_sizes = stage_windows(window_size, num_stages, 'window_size', 1)
        self.pretrained_window_sizes = stage_windows(
            pretrained_window_sizes, num_stages, 'pretrained_window_sizes', 0,
            pair_for_all=False)
        out_indices = int_tuple(out_indices, 'out_indices')
        if not out_indices or any(not 0 <= i < num_stages for i in out_indices) \
                or len(set(out_indices)) != len(out_indices):
            raise ValueError(f'out_indices={out_indices} must be a non-empty subset of stage '
                             f'indices 0..{num_stages - 1} without duplicates')
        self.out_indices = tuple(sorted(out_indices))
        if not isinstance(frozen_stages, int) or isinstance(frozen_stages, bool) \
                or not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages={frozen_stages!r} must be in -1..{num_stages} '
                             '(-1: train all, 0: patch embedding, k: also the first k stages)')
        if not isinstance(mlp_ratio, numbers.Real) or isinstance(mlp_ratio, bool) \
                or mlp_ratio <= 0:
            raise ValueError(f'mlp_ratio must be positive, got {mlp_ratio!r}')
        for name, rate in (('drop_rate', drop_rate), ('attn_drop_rate', attn_drop_rate),
                           ('drop_path_rate', drop_path_rate)):
            check_rate(rate, name)
        for name, flag in (('qkv_bias', qkv_bias), ('patch_norm', patch_norm),
                           ('pad_small_map', pad_small_map), ('norm_eval', norm_eval),
                           ('with_cp', with_cp), ('fused_attn', fused_attn)):
            check_flag(flag, name)
        self.accel = check_accel(accel)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        norm_cfg = norm_cfg or dict(type='LN')

        patch_norm_layer = build_norm_layer(norm_cfg, self.embed_dims)[1] if patch_norm else None
        self.patch_embed = PatchEmbed(patch_size, in_channels, self.embed_dims, patch_norm_layer)
        self.drop_after_pos = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()
        rates = linear_drop_path_rates(drop_path_rate, sum(self.depths))
        self.layers = nn.ModuleList()
        for i, depth in enumerate(self.depths):
            start = sum(self.depths[:i])
            self.layers.append(SwinV2Stage(
                dims[i], depth, self.num_heads[i], self.window_sizes[i],
                drop_paths=rates[start:start + depth], downsample=i < num_stages - 1,
                norm_cfg=norm_cfg, with_cp=with_cp,
                extra_norm_every_n_blocks=spec.extra_norm_every_n_blocks,
                pretrained_window_size=self.pretrained_window_sizes[i],
                pad_small_map=pad_small_map, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                drop=drop_rate, attn_drop=attn_drop_rate, act_cfg=act_cfg,
                fused_attn=fused_attn, accel=accel))
        for i in self.out_indices:
            self.add_module(f'norm{i}', build_norm_layer(norm_cfg, dims[i])[1])

        self.num_features: Tuple[int, ...] = tuple(dims)
        self.out_channels = tuple(dims[i] for i in self.out_indices)
        self.out_strides = tuple(patch_size * 2**i for i in self.out_indices)
        self.num_layers = sum(self.depths)
        self._freeze_stages()

    def init_weights(self) -> None:
        """Load ``init_cfg.checkpoint`` through the converters, or initialise as the official
        code: truncated-normal linears, ``logit_scale = log(10)``, zero q / v biases, and the
        blocks' post-norms at zero (each block starts as the identity)."""
        pretrained = pretrained_init_cfg(self.init_cfg)
        if pretrained is not None:
            load_swin_v2_pretrained(self, pretrained['checkpoint'],
                                    prefix=pretrained.get('prefix'))
            self._is_init = True
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

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> maps ``(B, C_i, ceil(H / s_i), ceil(W / s_i))``."""
        x = self.drop_after_pos(self.patch_embed(x))                 # (B, H/p, W/p, C)
        outs: List[Tensor] = []
        for i, stage in enumerate(self.layers):
            out, x = stage(x)                                        # (B, H_i, W_i, C_i)
            if i in self.out_indices:
                norm = getattr(self, f'norm{i}')
                outs.append(norm(out).permute(0, 3, 1, 2).contiguous())  # (B, C_i, H_i, W_i)
        return tuple(outs)
