"""DEIMv2's DINOv3 backbone: a plain DINOv3 ViT whose taps become a stride 8 / 16 / 32 pyramid
with the detail of a small conv stem, the Spatial Tuning Adapter (STA).

Three blocks of the ViT are tapped and bilinearly resized to strides 8 / 16 / 32 (DEIMv2's
patch 16: the first upsampled 2x, the second kept, the third downsampled 2x; any patch that
divides 32 works). The adapter (a stride-2 3x3 conv + BatchNorm + GELU, a stride-2 max-pool,
then three stride-2 3x3 conv + BatchNorm, GELU between them) gives detail maps of ``2c`` /
``4c`` / ``4c`` channels at strides 8 / 16 / 32. Each tap is concatenated with its detail map
and projected to ``hidden_dim`` by a 1x1 conv + BatchNorm.

Presets: DEIMv2's S / M (distilled ViT-Tiny / Tiny+: 192 / 256 wide, 3 / 4 heads, q / k / v
biases, no LayerScale, no registers, no final norm, taps 3 / 7 / 11) and L / X (DINOv3 ViT-S /
S+ with q / v biases, final norm on every tap, taps 5 / 8 / 11). Every block attends globally.
"""
import dataclasses
import re
from types import MappingProxyType
from typing import Any, ClassVar, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import CheckpointTarget
from ..layers.arguments import check_flags, int_tuple, positive_int
from ..layers.conv_blocks import ConvNorm
from .base import BackboneContract, init_cfg_from_pretrained, load_init_checkpoint, state_shapes
from .dinov3 import DINOv3Arch, DINOv3Backbone
from .plain_vit import PlainViTBackbone

#: Strides of the outputs (the taps resized by 2, 1, 1/2 from the patch stride 16).
OUT_STRIDES = (8, 16, 32)
#: Detail channels of each adapter output, in units of ``sta_channels``.
DETAIL_WIDTHS = (2, 4, 4)
#: Inputs are multiples of this (the coarsest output's stride) on both sides.
SIZE_DIVISOR = 32
#: DEIMv2's distilled ViT-Tiny / Tiny+ blocks: q / k / v biases, no LayerScale, no registers.
_DISTILLED = MappingProxyType(dict(depth=12, qkv_bias='qkv', layer_scale=None,
                                   num_reg_tokens=0, norm_eps=1e-6))

#: DEIMv2's sizes: the ViT (a DINOv3Backbone arch), its taps, whether the final norm applies to
#: them, the adapter width and the output width.
STA_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    'S': dict(vit=dict(_DISTILLED, embed_dims=192, num_heads=3), taps=(3, 7, 11),
              final_norm=False, sta_channels=16, hidden_dim=192),
    'M': dict(vit=dict(_DISTILLED, embed_dims=256, num_heads=4), taps=(3, 7, 11),
              final_norm=False, sta_channels=16, hidden_dim=256),
    'L': dict(vit=dict(DINOv3Arch.PRESETS['small'], qkv_bias='qv'), taps=(5, 8, 11),
              final_norm=True, sta_channels=32, hidden_dim=224),
    'X': dict(vit=dict(DINOv3Arch.PRESETS['small_plus'], qkv_bias='qv'), taps=(5, 8, 11),
              final_norm=True, sta_channels=64, hidden_dim=256),
})


class SpatialTuningAdapter(nn.Module):
    """DEIMv2's conv stem: detail maps of ``2c`` / ``4c`` / ``4c`` channels at strides
    8 / 16 / 32 (``c = channels``)."""

    def __init__(self, channels: int, in_channels: int = 3) -> None:
        super().__init__()
        c = channels
        self.stem_conv = ConvNorm(in_channels, c, 3, 2, act='gelu')
        self.stem_pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.conv2 = ConvNorm(c, 2 * c, 3, 2)
        self.conv3 = ConvNorm(2 * c, 4 * c, 3, 2)
        self.conv4 = ConvNorm(4 * c, 4 * c, 3, 2)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        c8 = self.conv2(self.stem_pool(self.stem_conv(x)))           # (B, 2c, H/8, W/8)
        c16 = self.conv3(F.gelu(c8))                                 # (B, 4c, H/16, W/16)
        c32 = self.conv4(F.gelu(c16))                                # (B, 4c, H/32, W/32)
        return c8, c16, c32


@MODELS.register_module()
class DINOv3STABackbone(BackboneContract, BaseModule):
    """DEIMv2's DINOv3 + Spatial Tuning Adapter (module docstring).

    Args:
        arch: a preset (``'S'``, ``'M'``, ``'L'``, ``'X'``: :data:`STA_PRESETS`).
        vit: the ViT's arch (a DINOv3Backbone preset name or arch dict); default the preset's.
        taps: the three ViT blocks tapped (strides 8 / 16 / 32 after resizing).
        final_norm: the ViT's final norm on every tap (L / X: yes; S / M: no).
        sta_channels: the adapter's base width ``c`` (detail maps ``2c`` / ``4c`` / ``4c``).
        hidden_dim: channels of every output.
        frozen_stages: the ViT's (``-1``: train all; ``k >= 0``: its embeddings and first
            ``k`` blocks frozen).
        with_cp: activation checkpointing per ViT block.
        vit_args: more DINOv3Backbone arguments (``drop_path_rate``, ``rope``, ...).
        pretrained: deprecated spelling of ``init_cfg=dict(type='Pretrained', checkpoint=...)``.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)``: a transformers DEIMv2 folder.

    Attributes:
        out_channels: ``(hidden_dim,) * 3``; out_strides: ``(8, 16, 32)``.
    """

    NO_DECAY_PARAMS: ClassVar[Tuple[str, ...]] = PlainViTBackbone.NO_DECAY_PARAMS
    FAMILY = 'DINOv3 STA'

    def __init__(self,
                 arch: str = 'S',
                 vit: Union[str, dict, None] = None,
                 taps: Optional[Sequence[int]] = None,
                 final_norm: Optional[bool] = None,
                 sta_channels: Optional[int] = None,
                 hidden_dim: Optional[int] = None,
                 frozen_stages: int = -1,
                 with_cp: bool = False,
                 vit_args: Optional[Mapping[str, Any]] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        if arch not in STA_PRESETS:
            raise ValueError(f'unknown DEIMv2 DINOv3 arch {arch!r}; choose one of '
                             f'{sorted(STA_PRESETS)} (and override vit / taps / final_norm / '
                             'sta_channels / hidden_dim)')
        preset = STA_PRESETS[arch]
        vit_arch = preset['vit'] if vit is None else vit
        taps = int_tuple(preset['taps'] if taps is None else taps, 'taps')
        final_norm = preset['final_norm'] if final_norm is None else final_norm
        check_flags(final_norm=final_norm)
        c = positive_int(preset['sta_channels'] if sta_channels is None else sta_channels,
                         'sta_channels')
        dim = positive_int(preset['hidden_dim'] if hidden_dim is None else hidden_dim,
                           'hidden_dim')
        if len(taps) != len(OUT_STRIDES):
            raise ValueError(f'taps={taps} must name {len(OUT_STRIDES)} ViT blocks (strides '
                             f'{OUT_STRIDES})')
        args = dict(vit_args or {})
        for own in ('arch', 'out_indices', 'final_norm', 'global_attn_indexes'):
            if own in args:
                raise ValueError(f'vit_args sets {own!r}, which DINOv3STABackbone sets itself: '
                                 'give it as vit= / taps= / final_norm= (every block is global)')
        depth = DINOv3Backbone.ARCH.resolve(vit_arch).depth
        self.vit = DINOv3Backbone(arch=vit_arch, out_indices=taps, final_norm=final_norm,
                                  global_attn_indexes=range(depth),
                                  frozen_stages=frozen_stages, with_cp=with_cp, **args)
        if SIZE_DIVISOR % self.vit.patch_size:
            raise ValueError(f'DINOv3STABackbone needs a ViT patch that divides {SIZE_DIVISOR} '
                             f'(its taps are resized to strides {OUT_STRIDES} of inputs padded to '
                             f'{SIZE_DIVISOR}), got patch {self.vit.patch_size}: give '
                             'vit_args=dict(patch_size=16) (DEIMv2\'s) or 8')
        if len(set(self.vit.out_indices)) != len(taps):
            raise ValueError(f'taps={taps} must be {len(taps)} different blocks')
        self.sta = SpatialTuningAdapter(c)
        embed = self.vit.embed_dims
        self.fusion_proj = nn.ModuleList(ConvNorm(embed + w * c, dim) for w in DETAIL_WIDTHS)
        self.out_channels = (dim,) * len(OUT_STRIDES)
        self.out_strides = OUT_STRIDES
        self.num_layers = self.vit.num_layers

    def fit_input(self, size: Tuple[int, int]) -> Tuple[int, int]:
        """``size`` rounded up to multiples of 32 (the adapter's and the taps' grids agree)."""
        return tuple(-(-s // SIZE_DIVISOR) * SIZE_DIVISOR for s in size)  # type: ignore

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, 3, H, W)``, sides multiples of 32 -> three ``(B, hidden_dim, H / s, W / s)``
        maps, ``s`` = 8, 16, 32."""
        h, w = x.shape[-2:]
        if h % SIZE_DIVISOR or w % SIZE_DIVISOR:
            raise ValueError(f'DINOv3STABackbone takes sides that are multiples of '
                             f'{SIZE_DIVISOR}, got {h}x{w}: pad the batch to a multiple of '
                             f'{SIZE_DIVISOR} (pad_size_divisor={SIZE_DIVISOR})')
        outs = []
        for tap, detail, stride, proj in zip(self.vit(x), self.sta(x), OUT_STRIDES,
                                             self.fusion_proj):
            # (B, C, H / 16, W / 16) -> (B, C, H / s, W / s): sizes by integer division, which
            # stays symbolic in an exported graph
            tap = F.interpolate(tap, size=(h // stride, w // stride), mode='bilinear',
                                align_corners=False)
            outs.append(proj(torch.cat([tap, detail], dim=1)))      # (B, hidden_dim, h, w)
        return tuple(outs)

    def layer_id(self, name: str) -> int:
        """The ViT's layer ids under ``vit.``; the adapter and the projections after the last
        block (``num_layers + 1``)."""
        m = re.match(r'^vit\.', name)
        return self.vit.layer_id(name[m.end():]) if m else self.num_layers + 1

    def checkpoint_target(self) -> CheckpointTarget:
        """The ViT's target (rope, patch, arch) for the whole module's state dict."""
        return dataclasses.replace(self.vit.checkpoint_target(), family=self.FAMILY,
                                   owner=type(self).__name__, expected=state_shapes(self))

    def frozen_modules(self) -> List[nn.Module]:
        return self.vit.frozen_modules()

    def init_weights(self) -> None:
        """Load the ``init_cfg`` checkpoint (a transformers DEIMv2 folder), or initialise the
        ViT as timm and the convs with PyTorch's defaults."""
        if not load_init_checkpoint(self):
            super().init_weights()
