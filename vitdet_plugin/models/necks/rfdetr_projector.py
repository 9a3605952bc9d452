"""RF-DETR's multi-scale projector: ViT taps -> C2f -> one or several pyramid levels.

LW-DETR / RF-DETR feed the decoder from the concatenated taps of a plain ViT (all at the patch
stride). Per output level, every tap is resampled (P3: a 2x deconvolution; P4: as is; P5: a
stride-2 3x3 conv + norm + ReLU), the resampled taps are concatenated on channels and fused by a
C2f block (YOLOv8's CSP bottleneck with two convs: conv + norm + SiLU everywhere, channel
LayerNorm in RF-DETR) and a final channel LayerNorm. P6 is a stride-2 1x1 max-pool of the last
level. The deconvolution is ViTDet's (:func:`~..layers.pyramid.scale_resampler`, shared with
:class:`ViTSimpleFPN`); the norm is :func:`build_norm2d`'s ``LN2d`` (RF-DETR's channel
LayerNorm, eps 1e-6) or any mmcv norm (RF-DETR's ``layer_norm=False`` is BatchNorm).

Checkpoint keys of RF-DETR (``backbone.0.projector.*``) map onto this module through
:func:`~vitdet_plugin.weights.rfdetr_keys.rfdetr_projector_key`.
"""
from types import MappingProxyType
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import checkpoint_loader
from ..layers.pyramid import DEFAULT_NORM_CFG, build_norm2d, scale_resampler

#: Pyramid level -> resampling scale of the patch-stride taps (P6 is a max-pool of the last).
LEVEL_SCALES: Mapping[str, float] = MappingProxyType({'P3': 2.0, 'P4': 1.0, 'P5': 0.5})
#: The pooled extra level (RF-DETR's ``scale_factor`` 0.25).
POOLED_LEVEL = 'P6'
#: Hidden channels of the C2f block relative to its output (``e`` in YOLOv8 / RF-DETR).
C2F_EXPANSION = 0.5
#: Activations: RF-DETR's C2f (SiLU), its P5 stride-2 conv (ReLU), its P3 deconv pair (GELU).
C2F_ACT: Mapping[str, Any] = MappingProxyType(dict(type='SiLU'))
DOWN_ACT: Mapping[str, Any] = MappingProxyType(dict(type='ReLU'))
DECONV_ACT: Mapping[str, Any] = MappingProxyType(dict(type='GELU'))


class ConvNormAct(nn.Module):
    """``conv (no bias) -> norm -> act`` on NCHW maps, ``kernel // 2`` padding (RF-DETR's
    ``ConvX``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 norm_cfg: Optional[Mapping[str, Any]], act_cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                              padding=kernel_size // 2, bias=False)
        self.norm = build_norm2d(norm_cfg, out_channels)
        self.act = build_activation_layer(dict(act_cfg))

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.norm(self.conv(x)))


class C2f(nn.Module):
    """YOLOv8's C2f: a 1x1 conv split in two halves, ``num_blocks`` chained 3x3-3x3 blocks
    (no shortcut) on the second half, every intermediate concatenated, then a 1x1 conv."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int,
                 norm_cfg: Optional[Mapping[str, Any]]) -> None:
        super().__init__()
        self.hidden = int(out_channels * C2F_EXPANSION)
        hid = self.hidden
        self.conv_in = ConvNormAct(in_channels, 2 * hid, 1, 1, norm_cfg, C2F_ACT)
        self.blocks = nn.ModuleList(
            nn.Sequential(ConvNormAct(hid, hid, 3, 1, norm_cfg, C2F_ACT),
                          ConvNormAct(hid, hid, 3, 1, norm_cfg, C2F_ACT))
            for _ in range(num_blocks))
        self.conv_out = ConvNormAct((2 + num_blocks) * hid, out_channels, 1, 1, norm_cfg,
                                    C2F_ACT)

    def forward(self, x: Tensor) -> Tensor:
        parts = list(self.conv_in(x).split((self.hidden, self.hidden), 1))  # 2 x (B, hid, H, W)
        for block in self.blocks:
            parts.append(block(parts[-1]))
        return self.conv_out(torch.cat(parts, 1))          # (B, (2 + n) * hid, H, W) -> out


def _sampler(scale: float, dim: int, norm_cfg: Optional[Mapping[str, Any]]
             ) -> Tuple[nn.Module, int]:
    """The resampling of one tap to one level and its output channels."""
    if scale == 0.5:
        return nn.Sequential(ConvNormAct(dim, dim, 3, 2, norm_cfg, DOWN_ACT)), dim
    return scale_resampler(scale, dim, DEFAULT_NORM_CFG, dict(DECONV_ACT))  # P3 / P4: ViTDet's


@MODELS.register_module()
class RFDETRProjector(BaseModule):
    """RF-DETR's multi-scale projector (a neck after a ViT's taps).

    Args:
        in_channels: channels of each tap (e.g. ``(384,) * 4`` for RF-DETR's ViT-S taps).
        out_channels: channels of every output level (the decoder width).
        levels: output levels, ascending, from ``P3`` / ``P4`` / ``P5`` (then optionally
            ``P6``, pooled from the last); RF-DETR's detection sizes use ``('P4',)``.
        in_stride: stride of the taps (the ViT patch size).
        num_blocks: C2f blocks per level.
        norm_cfg: norm of the convs (``LN2d``: RF-DETR's ``layer_norm``; ``dict(type='BN')``:
            its ``layer_norm=False``); the norm after each C2f is a channel LayerNorm always.
        init_cfg: mmengine init config.

    Attributes:
        out_channels: channels of each output (tuple).
        out_strides: stride of each output (tuple).
    """

    def __init__(self,
                 in_channels: Union[int, Sequence[int]] = (384, 384, 384, 384),
                 out_channels: int = 256,
                 levels: Sequence[str] = ('P4',),
                 in_stride: int = 16,
                 num_blocks: int = 3,
                 norm_cfg: Optional[Mapping[str, Any]] = DEFAULT_NORM_CFG,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        taps = [in_channels] if isinstance(in_channels, int) else [int(c) for c in in_channels]
        levels = tuple(levels)
        known = (*LEVEL_SCALES, POOLED_LEVEL)
        if not taps or min(taps) <= 0:
            raise ValueError(f'in_channels={in_channels!r} must give the positive channels of '
                             'each tap')
        if (not levels or any(lvl not in known for lvl in levels)
                or list(levels) != sorted(set(levels)) or levels[0] == POOLED_LEVEL):
            raise ValueError(f'levels={levels} must be distinct levels of {known} in ascending '
                             f'order, with {POOLED_LEVEL} (pooled from the last) only after '
                             "another, e.g. ('P4',) or ('P3', 'P4', 'P5', 'P6')")
        if 'P3' in levels and any(c % 2 for c in taps):
            raise ValueError(f'in_channels={taps} must be even for P3 (the deconv halves them)')
        if num_blocks < 1:
            raise ValueError(f'num_blocks must be >= 1, got {num_blocks}')
        self.in_channels = taps
        self.levels = levels
        self.samplers = nn.ModuleList()
        self.fusions = nn.ModuleList()
        self.norms = nn.ModuleList()
        for level in levels:
            if level == POOLED_LEVEL:
                continue
            samplers, fused = nn.ModuleList(), 0
            for dim in taps:
                sampler, dim_out = _sampler(LEVEL_SCALES[level], dim, norm_cfg)
                samplers.append(sampler)
                fused += dim_out
            self.samplers.append(samplers)
            self.fusions.append(C2f(fused, out_channels, num_blocks, norm_cfg))
            self.norms.append(build_norm2d(DEFAULT_NORM_CFG, out_channels))  # LN always
        self.out_channels: Tuple[int, ...] = (out_channels,) * len(levels)
        self.out_strides: Tuple[int, ...] = tuple(
            int(in_stride * 2 ** (int(lvl[1]) - 4)) for lvl in levels)

    def init_weights(self) -> None:
        """Load ``init_cfg``'s pretrained projector as saved by a detector of ours (the part
        under ``prefix``, ``'neck.'`` when none is given; strict: missing, unexpected or
        mis-shaped keys raise naming them), or keep the constructor init."""
        cfg = self.init_cfg
        if isinstance(cfg, dict) and cfg.get('type') == 'Pretrained':
            expected = {k: v.shape for k, v in self.state_dict().items()}
            state_dict, _ = checkpoint_loader().read_as_saved(
                cfg['checkpoint'], cfg.get('prefix') or 'neck.', expected, type(self).__name__,
                f"checkpoint {cfg['checkpoint']}")
            self.load_state_dict(state_dict)
            self._is_init = True
            return
        super().init_weights()

    def forward(self, taps: Union[Tensor, Sequence[Tensor]]) -> Tuple[Tensor, ...]:
        """``len(in_channels)`` maps ``(B, C_i, h, w)`` -> one map per level
        ``(B, out_channels, h * scale, w * scale)`` (P6 rounds down, as the max-pool)."""
        taps = [taps] if isinstance(taps, Tensor) else list(taps)
        if len(taps) != len(self.in_channels) or any(
                x.dim() != 4 or x.shape[1] != c for x, c in zip(taps, self.in_channels)):
            raise ValueError(f'{type(self).__name__} expects {len(self.in_channels)} maps with '
                             f'channels {self.in_channels} (in_channels), got '
                             f'{[tuple(x.shape) for x in taps]}')
        outs: List[Tensor] = []
        for samplers, fusion, norm in zip(self.samplers, self.fusions, self.norms):
            resampled = [s(x) for s, x in zip(cast(nn.ModuleList, samplers), taps)]
            fused = torch.cat(resampled, 1)                     # (B, sum C_i', h', w')
            outs.append(norm(fusion(fused)))
        if self.levels[-1] == POOLED_LEVEL:
            outs.append(F.max_pool2d(outs[-1], kernel_size=1, stride=2))
        return tuple(outs)

    def extra_repr(self) -> str:
        return f'in_channels={self.in_channels}, levels={self.levels}'

