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
from typing import List, Optional, Sequence, Tuple, Union

from mmcv.cnn import build_norm_layer
from mmdet.registry import MODELS
from torch import nn

from ...functional.checkpoint_target import CheckpointTarget
from ...functional.sizes import Window, pair_or_none
from ..layers.arguments import check_flags, check_rates, positive_number, refuse_removed
from ..layers.patch_merging import PatchMerging
from .base import (init_cfg_from_pretrained, init_transformer_weights_, load_init_checkpoint,
                   state_shapes)
from .hierarchical import WindowBackbone
from .swin_archs import SwinV2Arch
from .swin_v2_block import LOGIT_SCALE_INIT, CosineWindowAttention, SwinV2Block

#: A window: an int (square) or ``(h, w)``; per stage: one of those, or a sequence of them.
WindowArg = Union[int, Sequence[int], Sequence[Union[int, Sequence[int]]]]


def stage_windows(value: WindowArg, num_stages: int, name: str, minimum: int,
                  pair_for_all: bool = True) -> Tuple[Window, ...]:
    """One ``(h, w)`` per stage from an int, one int / ``(h, w)`` per stage, or (with
    ``pair_for_all``) a pair of ints: one ``(h, w)`` for all stages, as in timm. Sides below
    ``minimum`` are refused (0 may mean "the stage's own window")."""
    windows: List[Optional[Window]] = [pair_or_none(value)] * num_stages
    if isinstance(value, (tuple, list)) and not (pair_for_all and windows[0] is not None):
        windows = [pair_or_none(v) for v in value] if len(value) == num_stages else [None]
    found = [w for w in windows if w is not None]
    if len(found) != num_stages:
        form = 'an int or a pair (h, w), or' if pair_for_all else 'an int or'
        raise ValueError(f'{name} must be {form} one int or (h, w) pair per stage (the model '
                         f'has {num_stages} stages), got {value!r}')
    if any(min(w) < minimum for w in found):
        bound = 'positive' if minimum > 0 else f'>= {minimum} (0: the stage\'s own window)'
        raise ValueError(f'{name} must be {bound}, got {value!r}')
    return tuple(found)


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
        out_indices, frozen_stages, norm_eval, with_cp, norm_cfg, act_cfg, in_channels,
            patch_size, removed: as :class:`~.swin.SwinBackbone`.
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
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None,
                 **removed: object) -> None:
        refuse_removed(type(self).__name__, removed)
        init_cfg = init_cfg_from_pretrained(pretrained, init_cfg)
        spec = SwinV2Arch.resolve(arch, embed_dims=embed_dims, depths=depths,
                                  num_heads=num_heads)
        num_stages = len(spec.depths)
        windows = stage_windows(window_size, num_stages, 'window_size', 1)
        pretrained_windows = stage_windows(
            pretrained_window_sizes, num_stages, 'pretrained_window_sizes', 0,
            pair_for_all=False)
        positive_number(mlp_ratio, 'mlp_ratio')
        check_rates(attn_drop_rate=attn_drop_rate)
        check_flags(qkv_bias=qkv_bias, pad_small_map=pad_small_map)
        norm_cfg = norm_cfg or dict(type='LN')
        every = spec.extra_norm_every_n_blocks

        def block(stage: int, index: int, dim: int, heads: int, drop_path: float) -> nn.Module:
            """W-MSA and SW-MSA blocks in turn; a final norm every
            ``extra_norm_every_n_blocks``."""
            return SwinV2Block(dim, heads, windows[stage], pretrained_windows[stage],
                               shift=index % 2 == 1, pad_small_map=pad_small_map,
                               extra_norm=bool(every) and (index + 1) % every == 0,
                               mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                               attn_drop=attn_drop_rate, drop_path=drop_path, norm_cfg=norm_cfg,
                               act_cfg=act_cfg)

        def merge(dim: int) -> nn.Module:
            """Concat 2x2 -> linear ``4C -> 2C`` -> norm (post-norm)."""
            return PatchMerging(dim, build_norm_layer(norm_cfg, 2 * dim)[1], post_norm=True)

        super().__init__(
            spec, block, merge, in_channels=in_channels, patch_size=patch_size,
            out_indices=out_indices, frozen_stages=frozen_stages, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, patch_norm=patch_norm, norm_eval=norm_eval,
            with_cp=with_cp, norm_cfg=norm_cfg, init_cfg=init_cfg)
        self.window_sizes, self.pretrained_window_sizes = windows, pretrained_windows

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
