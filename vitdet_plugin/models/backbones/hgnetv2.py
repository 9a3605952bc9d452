"""HGNetV2 (PaddleDetection's PP-HGNetV2), the CNN backbone of D-FINE and DEIMv2.

A stem (two 2x2 branches, a max-pool branch, stride 4) and stages of HG blocks: each block runs
``num_layers`` convs in a chain (3x3, or a "light" 1x1 + depthwise pair), concatenates the input
and every intermediate map and squeezes them with two 1x1 convs (a residual from the second
block on); a stage opens with a depthwise stride-2 conv. Every conv is conv + BatchNorm +
ReLU, optionally followed by a learnable affine ``scale * x + bias`` (``use_lab``). Presets
B0-B6 and DEIMv2's three-stage Atto / Femto / Pico are the reference's ``arch_configs``;
parameter names are the reference's (``stem.stem1.conv``, ``stages.{i}.blocks.{j}.layers.{k}``,
``.bn``, ``.lab``), so its ImageNet checkpoints load as they are.
"""
import dataclasses
import re
from typing import ClassVar, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import CheckpointTarget
from ..layers.arguments import check_flags, int_tuple
from ..layers.conv_blocks import BN_EPS, make_activation
from .base import (ArchSpec, BackboneContract, init_cfg_from_pretrained, load_init_checkpoint,
                   state_shapes)

#: The stem's stride (stem1 and stem3 are stride 2).
STEM_STRIDE = 4
#: Kernel of the stem's 2x2 branch convs and its max-pool (padded by one on the bottom-right).
STEM_PAIR_KERNEL = 2
#: Kernel and stride of a stage's depthwise downsampling conv.
DOWNSAMPLE_KERNEL, DOWNSAMPLE_STRIDE = 3, 2

_B0 = dict(stem_channels=(3, 16, 16), in_channels=(16, 64, 256, 512),
           mid_channels=(16, 32, 64, 128), out_channels=(64, 256, 512, 1024),
           num_blocks=(1, 1, 2, 1), downsample=(False, True, True, True),
           light_block=(False, False, True, True), kernel_size=(3, 3, 5, 5),
           num_layers=(3, 3, 3, 3))


def _three_stages(**changes: Tuple) -> dict:
    """DEIMv2's pruned B0: its first three stages, with ``changes``."""
    spec = {k: v[:3] if isinstance(v, tuple) and k != 'stem_channels' else v
            for k, v in _B0.items()}
    spec.update(changes)
    return spec


def _stages(stem: Tuple[int, int, int], mid: Tuple[int, ...], out: Tuple[int, ...],
            blocks: Tuple[int, ...], layers: int) -> dict:
    """A four-stage preset (stage ``i`` takes stage ``i - 1``'s output; stage 0 the stem's)."""
    return dict(stem_channels=stem, in_channels=(stem[2],) + out[:3], mid_channels=mid,
                out_channels=out, num_blocks=blocks, downsample=(False, True, True, True),
                light_block=(False, False, True, True), kernel_size=(3, 3, 5, 5),
                num_layers=(layers,) * 4)


@dataclasses.dataclass(frozen=True)
class HGNetV2Arch(ArchSpec):
    """Stem widths ``(in, mid, out)`` and per stage: input / mid / output widths, HG blocks,
    whether it downsamples, light (1x1 + depthwise) layers, kernel and layers per block."""

    stem_channels: Tuple[int, int, int]
    in_channels: Tuple[int, ...]
    mid_channels: Tuple[int, ...]
    out_channels: Tuple[int, ...]
    num_blocks: Tuple[int, ...]
    downsample: Tuple[bool, ...]
    light_block: Tuple[bool, ...]
    kernel_size: Tuple[int, ...]
    num_layers: Tuple[int, ...]

    NAME: ClassVar[str] = 'HGNetV2'
    PRESETS: ClassVar = {
        'B0': _B0,
        'B1': _stages((3, 24, 32), (32, 48, 96, 192), (64, 256, 512, 1024), (1, 1, 2, 1), 3),
        'B2': _stages((3, 24, 32), (32, 64, 128, 256), (96, 384, 768, 1536), (1, 1, 3, 1), 4),
        'B3': _stages((3, 24, 32), (32, 64, 128, 256), (128, 512, 1024, 2048), (1, 1, 3, 1), 5),
        'B4': _stages((3, 32, 48), (48, 96, 192, 384), (128, 512, 1024, 2048), (1, 1, 3, 1), 6),
        'B5': _stages((3, 32, 64), (64, 128, 256, 512), (128, 512, 1024, 2048), (1, 2, 5, 2), 6),
        'B6': _stages((3, 48, 96), (96, 192, 384, 768), (192, 512, 1024, 2048), (2, 3, 6, 3), 6),
        'Atto': _three_stages(out_channels=(64, 256, 256), kernel_size=(3, 3, 3),
                              num_blocks=(1, 1, 1)),
        'Femto': _three_stages(num_blocks=(1, 1, 1)),
        'Pico': _three_stages(),
    }

    def __post_init__(self) -> None:
        per_stage = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.name != 'stem_channels'}
        lengths = {k: len(v) for k, v in per_stage.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f'HGNetV2 arch: every per-stage field needs one entry per stage, '
                             f'got lengths {lengths}')
        if len(self.stem_channels) != 3:
            raise ValueError(f'HGNetV2 arch: stem_channels is (in, mid, out), got '
                             f'{self.stem_channels!r}')
        chain = (self.stem_channels[2],) + tuple(self.out_channels[:-1])
        if tuple(self.in_channels) != chain:
            raise ValueError(f'HGNetV2 arch: in_channels={tuple(self.in_channels)} must be the '
                             f'stem output then each previous stage output: {chain}')


class LearnableAffine(nn.Module):
    """``scale * x + bias`` with one learnable scalar each (HGNetV2's LAB), in ``x``'s dtype
    (under autocast the float32 scalars would otherwise promote bfloat16 maps to float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale.to(x.dtype) * x + self.bias.to(x.dtype)


class ConvBNAct(nn.Module):
    """``conv (no bias) -> bn -> act [-> lab]`` (the affine only after an activation)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 groups: int = 1, act: Optional[str] = 'relu', use_lab: bool = False,
                 padding: Optional[int] = None) -> None:
        super().__init__()
        pad = (kernel_size - 1) // 2 if padding is None else padding
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=pad,
                              groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=BN_EPS)
        self.act = make_activation(act)
        self.lab = LearnableAffine() if act is not None and use_lab else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.lab(self.act(self.bn(self.conv(x))))


class LightConvBNAct(nn.Module):
    """A 1x1 conv without activation, then a depthwise ``kernel_size`` conv with it."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, act: str,
                 use_lab: bool) -> None:
        super().__init__()
        self.conv1 = ConvBNAct(in_channels, out_channels, 1, act=None, use_lab=use_lab)
        self.conv2 = ConvBNAct(out_channels, out_channels, kernel_size, groups=out_channels,
                               act=act, use_lab=use_lab)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.conv1(x))


class StemBlock(nn.Module):
    """Stride-4 stem: a stride-2 3x3 conv, then a 2x2-conv pair and a 2x2 max-pool side by side
    (each on the map padded by one at the bottom-right), concatenated, a stride-2 3x3 and a
    1x1 conv."""

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int, act: str,
                 use_lab: bool) -> None:
        super().__init__()
        half = mid_channels // 2
        k = STEM_PAIR_KERNEL
        self.stem1 = ConvBNAct(in_channels, mid_channels, 3, 2, act=act, use_lab=use_lab)
        self.stem2a = ConvBNAct(mid_channels, half, k, act=act, use_lab=use_lab, padding=0)
        self.stem2b = ConvBNAct(half, mid_channels, k, act=act, use_lab=use_lab, padding=0)
        self.stem3 = ConvBNAct(mid_channels * 2, mid_channels, 3, 2, act=act, use_lab=use_lab)
        self.stem4 = ConvBNAct(mid_channels, out_channels, 1, act=act, use_lab=use_lab)
        self.pool = nn.MaxPool2d(kernel_size=k, stride=1, ceil_mode=True)

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(self.stem1(x), (0, 1, 0, 1))                       # (B, mid, H/2 + 1, W/2 + 1)
        branch = self.stem2b(F.pad(self.stem2a(x), (0, 1, 0, 1)))    # (B, mid, H/2, W/2)
        x = torch.cat([self.pool(x), branch], dim=1)                 # (B, 2 mid, H/2, W/2)
        return self.stem4(self.stem3(x))                             # (B, out, H/4, W/4)


class HGBlock(nn.Module):
    """``num_layers`` chained convs; the input and every output concatenated, squeezed to
    ``out_channels // 2`` and excited to ``out_channels`` by 1x1 convs; plus the input when
    ``residual``."""

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int,
                 num_layers: int, kernel_size: int, residual: bool, light_block: bool,
                 act: str, use_lab: bool) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(
            LightConvBNAct(in_channels if i == 0 else mid_channels, mid_channels, kernel_size,
                           act, use_lab) if light_block else
            ConvBNAct(in_channels if i == 0 else mid_channels, mid_channels, kernel_size,
                      act=act, use_lab=use_lab)
            for i in range(num_layers))
        total = in_channels + num_layers * mid_channels
        self.aggregation = nn.Sequential(
            ConvBNAct(total, out_channels // 2, 1, act=act, use_lab=use_lab),
            ConvBNAct(out_channels // 2, out_channels, 1, act=act, use_lab=use_lab))

    def forward(self, x: Tensor) -> Tensor:
        maps = [x]
        for layer in self.layers:
            maps.append(layer(maps[-1]))
        y = self.aggregation(torch.cat(maps, dim=1))                 # (B, out, H, W)
        return y + x if self.residual else y


class HGStage(nn.Module):
    """An optional depthwise stride-2 conv (no activation), then ``num_blocks`` HG blocks."""

    def __init__(self, spec: HGNetV2Arch, index: int, act: str, use_lab: bool) -> None:
        super().__init__()
        cin, mid, cout = spec.in_channels[index], spec.mid_channels[index], \
            spec.out_channels[index]
        self.downsample = (ConvBNAct(cin, cin, DOWNSAMPLE_KERNEL, DOWNSAMPLE_STRIDE, groups=cin,
                                     act=None) if spec.downsample[index] else nn.Identity())
        self.blocks = nn.Sequential(*(
            HGBlock(cin if j == 0 else cout, mid, cout, spec.num_layers[index],
                    spec.kernel_size[index], j > 0, spec.light_block[index], act, use_lab)
            for j in range(spec.num_blocks[index])))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.downsample(x))


@MODELS.register_module()
class HGNetV2Backbone(BackboneContract, BaseModule):
    """HGNetV2 (see the module docstring).

    Args:
        arch: a preset (``'B0'``..``'B6'``, DEIMv2's ``'Atto'`` / ``'Femto'`` / ``'Pico'``) or
            a dict of :class:`HGNetV2Arch` fields.
        out_indices: the stages returned (0-based, mmdet's convention: ``(1, 2, 3)`` gives
            strides 8 / 16 / 32 of a four-stage arch).
        use_lab: the learnable affine after every activation (D-FINE / DEIMv2 use it on
            B0-B2 and the pruned sizes).
        act: activation of every conv (``'relu'``).
        frozen_stages: ``-1`` trains all; ``0`` freezes the stem; ``k > 0`` the stem and the
            first ``k`` stages (parameters without gradient, BatchNorms in eval mode).
        norm_eval: keep every BatchNorm in eval mode (running statistics fixed) in training.
        pretrained: deprecated spelling of ``init_cfg=dict(type='Pretrained', checkpoint=...)``.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads an HGNetV2 checkpoint of
            any known layout (the reference's, a transformers D-FINE / DEIMv2 / HGNetV2 folder).

    Attributes:
        out_channels, out_strides: per returned stage.
    """

    NO_DECAY_PARAMS: ClassVar[Tuple[str, ...]] = ('lab',)
    FAMILY = 'HGNetV2'

    def __init__(self,
                 arch: Union[str, dict, HGNetV2Arch] = 'B4',
                 out_indices: Sequence[int] = (1, 2, 3),
                 use_lab: bool = False,
                 act: str = 'relu',
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        spec = arch if isinstance(arch, HGNetV2Arch) else HGNetV2Arch.resolve(arch)
        check_flags(use_lab=use_lab, norm_eval=norm_eval)
        make_activation(act)  # a clear error for an unknown name
        self.arch = spec
        num_stages = len(spec.out_channels)
        indices = int_tuple(out_indices, 'out_indices')
        if not indices or sorted(set(indices)) != list(indices) \
                or not all(0 <= i < num_stages for i in indices):
            raise ValueError(f'out_indices={tuple(out_indices)!r} must be ascending stage '
                             f'indices in [0, {num_stages - 1}] (this arch has {num_stages} '
                             'stages)')
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages={frozen_stages} must be in [-1, {num_stages}] '
                             '(-1: none, 0: the stem, k: the stem and k stages)')
        self.out_indices, self.frozen_stages, self.norm_eval = indices, frozen_stages, norm_eval
        self.stem = StemBlock(*spec.stem_channels, act=act, use_lab=use_lab)
        self.stages = nn.ModuleList(HGStage(spec, i, act, use_lab) for i in range(num_stages))
        strides, stride = [], STEM_STRIDE
        for down in spec.downsample:
            stride *= DOWNSAMPLE_STRIDE if down else 1
            strides.append(stride)
        self.out_channels = tuple(spec.out_channels[i] for i in indices)
        self.out_strides = tuple(strides[i] for i in indices)
        self.num_layers = num_stages
        self._freeze_stages()

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, 3, H, W)`` -> one ``(B, C_i, H / s_i, W / s_i)`` map per ``out_indices``."""
        x = self.stem(x)                                             # (B, C, H/4, W/4)
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)

    def layer_id(self, name: str) -> int:
        """The stem 0, stage ``i`` ``i + 1``."""
        m = re.match(r'^stages\.(\d+)\.', name)
        return int(m.group(1)) + 1 if m else 0

    def frozen_modules(self) -> List[nn.Module]:
        """The stem, then the first ``frozen_stages`` stages."""
        if self.frozen_stages < 0:
            return []
        return [self.stem] + list(self.stages[:self.frozen_stages])

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts an HGNetV2 checkpoint for."""
        return CheckpointTarget(self.FAMILY, type(self).__name__, state_shapes(self),
                                arch_presets=HGNetV2Arch.PRESETS)

    def init_weights(self) -> None:
        """Load the ``init_cfg`` checkpoint, or keep PyTorch's default initialisation."""
        if not load_init_checkpoint(self):
            super().init_weights()
