"""ViTDet's simple feature pyramid: a multi-scale pyramid built from one stride-16 map.

Li et al., *Exploring Plain Vision Transformer Backbones for Object Detection* (2022), as in
detectron2's ``SimpleFeaturePyramid``: per level, resample the single backbone map
(scale 4: deconv 2x, LayerNorm2d, GELU, deconv 2x; scale 2: one deconv; scale 1: identity;
scale 0.5: 2x2 max-pool), then ``1x1 conv + norm`` and ``3x3 conv + norm``. Extra coarser
levels are taken with a stride-2 1x1 max-pool of the last level (detectron2's
``LastLevelMaxPool``, mmdet ``FPN``'s extra outputs without convs).

It is the neck of a :class:`~vitdet_plugin.models.backbones.ViTBackbone` in a config, as
detectron2's ``SimpleFeaturePyramid(net=ViT(...))``::

    backbone=dict(type='ViTBackbone', arch='base'),      # one stride-16 map, 768 channels
    neck=dict(type='ViTSimpleFPN', in_channels=768, in_stride=16, out_channels=256,
              scale_factors=(4.0, 2.0, 1.0, 0.5), num_outs=5),  # strides 4, 8, 16, 32, 64

and declares its outputs (``out_channels`` / ``out_strides``) for the heads. Pretrained weights
(detectron2 ViTDet's ``simfp_*`` modules, or a detector checkpoint of ours) load through
``init_cfg=dict(type='Pretrained', checkpoint=...)`` (see :meth:`ViTSimpleFPN.init_weights`).
"""
import math
from typing import Any, ClassVar, List, Mapping, Optional, Sequence, Tuple, Union

import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import CheckpointTarget, checkpoint_loader
from ..layers.arguments import int_arg
from ..layers.pyramid import DEFAULT_NORM_CFG, SUPPORTED_SCALES, build_norm2d, scale_resampler

class ConvNorm(nn.Module):
    """``conv -> norm`` on NCHW maps; the conv has a bias only when there is no norm."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 norm_cfg: Optional[Mapping[str, Any]]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size,
                              padding=kernel_size // 2, bias=norm_cfg is None)
        self.norm = build_norm2d(norm_cfg, out_channels)
        nn.init.kaiming_uniform_(self.conv.weight, a=1)  # detectron2 c2_xavier_fill
        if self.conv.bias is not None:
            nn.init.zeros_(self.conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(x))


@MODELS.register_module()
class ViTSimpleFPN(BaseModule):
    """Simple feature pyramid from a single backbone map.

    Args:
        in_channels: channels of the backbone map (an int, or a sequence whose last entry is
            used: the neck reads the last backbone output).
        out_channels: channels of every pyramid level.
        scale_factors: resampling of each level relative to the input, strictly decreasing,
            each one of :data:`SUPPORTED_SCALES`; ``(4.0, 2.0, 1.0, 0.5)`` turns a stride-16
            map into strides 4, 8, 16, 32.
        in_stride: stride of the input map (the ViT patch size).
        num_outs: number of outputs; levels beyond ``len(scale_factors)`` are stride-2
            max-pools of the previous one. Defaults to ``len(scale_factors) + 1`` (strides
            4..64, the ViTDet detectors' pyramid).
        norm_cfg: norm after the first deconv (scale 4) and in the 1x1/3x3 convs
            (``dict(type='LN2d', eps=1e-6)``: detectron2's LayerNorm; ``None``: no norm, convs
            with bias).
        act_cfg: activation between the two deconvs of the scale-4 level.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH[, prefix=...])`` loads the pyramid
            of a detectron2 ViTDet checkpoint (``backbone.simfp_*``) or of a detector
            checkpoint of ours (``neck.*``; also ``backbone.pyramid.*``, where the pyramid
            sat before it was the neck), strictly (see :meth:`init_weights`); other
            ``init_cfg`` entries go to mmengine.

    Attributes:
        out_channels: channels of each output (tuple).
        out_strides: stride of each output (tuple).
    """

    def __init__(self,
                 in_channels: Union[int, Sequence[int]] = 768,
                 out_channels: int = 256,
                 scale_factors: Sequence[float] = (4.0, 2.0, 1.0, 0.5),
                 in_stride: int = 16,
                 num_outs: Optional[int] = None,
                 norm_cfg: Optional[Mapping[str, Any]] = DEFAULT_NORM_CFG,
                 act_cfg: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        if not isinstance(in_channels, int):
            in_channels = list(in_channels)
            if not in_channels:
                raise ValueError('in_channels is empty; give the backbone output channels')
            in_channels = int(in_channels[-1])
        if in_channels <= 0 or out_channels <= 0:
            raise ValueError(f'in_channels={in_channels} and out_channels={out_channels} must '
                             'be positive')
        scales = tuple(float(s) for s in scale_factors)
        if not scales or any(s not in SUPPORTED_SCALES for s in scales):
            raise ValueError(f'scale_factors={tuple(scale_factors)} is not supported: each '
                             f'must be one of {SUPPORTED_SCALES}')
        if any(a <= b for a, b in zip(scales, scales[1:])):
            raise ValueError(f'scale_factors={tuple(scale_factors)} must be strictly '
                             'decreasing (outputs are ordered from fine to coarse)')
        if (4.0 in scales and in_channels % 4) or (2.0 in scales and in_channels % 2):
            raise ValueError(f'in_channels={in_channels} must be divisible by the upsampling '
                             f'scale factors {scales} (the deconvs halve the channels)')
        if in_stride <= 0 or any((in_stride / s) % 1 for s in scales):
            raise ValueError(f'in_stride={in_stride} divided by the scale factors {scales} '
                             'must give integer output strides')
        num_outs = len(scales) + 1 if num_outs is None else int_arg(num_outs, 'num_outs')
        if num_outs < len(scales):
            raise ValueError(f'num_outs={num_outs} must be >= len(scale_factors)='
                             f'{len(scales)}; extra outputs are max-pooled from the last level')
        act_cfg = act_cfg or dict(type='GELU')
        self.in_channels = in_channels
        self.scale_factors = scales
        self.in_stride = in_stride
        self.num_outs = num_outs

        self.scales = nn.ModuleList()
        self.lateral_convs = nn.ModuleList()
        self.output_convs = nn.ModuleList()
        for scale in scales:
            resample, dim = scale_resampler(scale, in_channels, norm_cfg, act_cfg)
            self.scales.append(resample)
            self.lateral_convs.append(ConvNorm(dim, out_channels, 1, norm_cfg))
            self.output_convs.append(ConvNorm(out_channels, out_channels, 3, norm_cfg))

        strides: List[int] = [int(in_stride / s) for s in scales]
        while len(strides) < num_outs:
            strides.append(strides[-1] * 2)
        self.out_channels: Tuple[int, ...] = (out_channels,) * num_outs
        self.out_strides: Tuple[int, ...] = tuple(strides)

    #: see :data:`~vitdet_plugin.models.detectors.pretrained_parts.LOADS_PRETRAINED_ATTR`
    loads_pretrained_strictly: ClassVar[bool] = True
    #: The checkpoint family of the layout table: the pyramid, read out of any checkpoint.
    CHECKPOINT_FAMILY: ClassVar[str] = 'simple FPN'

    def init_weights(self) -> None:
        """Load ``init_cfg``'s pretrained pyramid (format detected, ``weights_only``, strict:
        missing, unexpected or mis-shaped keys raise naming them), or keep the constructor
        init (detectron2's: c2-xavier convs, PyTorch's deconvs)."""
        cfg = self.init_cfg
        if isinstance(cfg, dict) and cfg.get('type') == 'Pretrained':
            state_dict, _ = checkpoint_loader().convert(cfg['checkpoint'], self.checkpoint_target(),
                                                        cfg.get('prefix'))
            self.load_state_dict(state_dict)
            self._is_init = True
            return
        super().init_weights()

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader reads this pyramid for (its input stride places
        detectron2's ``simfp_*`` levels)."""
        return CheckpointTarget(self.CHECKPOINT_FAMILY, type(self).__name__,
                                {k: v.shape for k, v in self.state_dict().items()},
                                in_stride=self.in_stride)

    @property
    def level_names(self) -> Tuple[str, ...]:
        """detectron2's level names (``p2`` .. ``p6`` for strides 4 .. 64)."""
        return tuple(f'p{int(math.log2(s))}' for s in self.out_strides)

    def forward(self, inputs: Union[Tensor, Sequence[Tensor]]) -> Tuple[Tensor, ...]:
        """``(B, C_in, h, w)`` (or a tuple ending with it) -> ``num_outs`` maps
        ``(B, out_channels, h * scale, w * scale)`` (max-pools round down, as detectron2)."""
        x = inputs if isinstance(inputs, Tensor) else inputs[-1]
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f'{type(self).__name__} expects (B, {self.in_channels}, H, W) '
                             f'maps (in_channels={self.in_channels}), got '
                             f'{tuple(x.shape)}')
        outs = [out_conv(lateral(resample(x))) for resample, lateral, out_conv in
                zip(self.scales, self.lateral_convs, self.output_convs)]
        while len(outs) < self.num_outs:
            outs.append(F.max_pool2d(outs[-1], kernel_size=1, stride=2))
        return tuple(outs)
