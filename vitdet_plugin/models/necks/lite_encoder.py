"""DEIMv2's lite encoder (its Atto / Femto / Pico sizes): one backbone level in, two out.

The stride-16 map is projected (1x1 conv + BatchNorm), a stride-32 map made from it (3x3
average pool of stride 2, 1x1 conv + BatchNorm + act) and fused with its global average
(``conv(x + mean(x))``). One top-down step (the stride-32 map upsampled 2x, summed) and one
bottom-up step (the stride-16 output pooled and projected as before, summed) each end in a
RepNCSPELAN4 block with DEIMv2's split CSP layers.
"""
from typing import Optional, Sequence, Tuple

import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import CheckpointTarget
from ..layers.arguments import int_tuple, positive_int
from ..layers.conv_blocks import ConvNorm, RepNCSPELAN
from .hybrid_encoder import BASE_DEPTH, checkpoint_target_of, init_from_checkpoint

#: The average pool that halves a map (kernel, stride, padding).
POOL_KERNEL, POOL_STRIDE, POOL_PADDING = 3, 2, 1


class PoolConv(nn.Module):
    """``act(BN(conv1x1(avgpool3x3/2(x))))``: half the resolution, same width."""

    def __init__(self, channels: int, act: str) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(POOL_KERNEL, POOL_STRIDE, POOL_PADDING)
        self.conv = ConvNorm(channels, channels, act=act)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.pool(x))


@MODELS.register_module()
class LiteEncoder(BaseModule):
    """DEIMv2's lite encoder (module docstring).

    Args:
        in_channels: channels of the one input level.
        in_strides: its stride (the outputs are at it and twice it).
        hidden_dim: width of the encoder and of both outputs.
        expansion: branch width of the fusion blocks, ``round(expansion * hidden_dim // 2)``.
        depth_mult: RepVGG blocks per CSP layer, ``round(3 * depth_mult)``.
        act: activation of the convs.
        init_cfg: mmengine init config (``Pretrained``: a transformers DEIMv2 folder).

    Attributes:
        out_channels, out_strides: of the two outputs.
    """

    def __init__(self,
                 in_channels: Sequence[int] = (512,),
                 in_strides: Sequence[int] = (16,),
                 hidden_dim: int = 256,
                 expansion: float = 1.0,
                 depth_mult: float = 1.0,
                 act: str = 'silu',
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        chans, strides = int_tuple(in_channels, 'in_channels'), int_tuple(in_strides, 'in_strides')
        if len(chans) != 1 or len(strides) != 1:
            raise ValueError(f'LiteEncoder takes one input level, got in_channels={chans}, '
                             f'in_strides={strides}; for several levels use HybridEncoder')
        dim = positive_int(hidden_dim, 'hidden_dim')
        self.in_channels = chans
        self.out_channels, self.out_strides = (dim, dim), (strides[0], 2 * strides[0])
        self.input_proj = nn.ModuleList([ConvNorm(chans[0], dim)])
        self.down1 = PoolConv(dim, act)
        self.down2 = PoolConv(dim, act)
        self.gap_fusion = ConvNorm(dim, dim, act=act)
        blocks, branch = round(BASE_DEPTH * depth_mult), round(expansion * dim // 2)
        self.fpn_block = RepNCSPELAN(dim, dim, 2 * dim, branch, blocks, act, 'csp2', True)
        self.pan_block = RepNCSPELAN(dim, dim, 2 * dim, branch, blocks, act, 'csp2', True)

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a DEIMv2 checkpoint's lite encoder for."""
        return checkpoint_target_of(self)

    def init_weights(self) -> None:
        """Load the ``init_cfg`` checkpoint's encoder (a transformers DEIMv2 folder, strict),
        or keep PyTorch's default initialisation."""
        init_from_checkpoint(self)

    def forward(self, feats: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
        """``[(B, C_in, H, W)]`` -> ``(B, hidden, H, W)`` and ``(B, hidden, H/2, W/2)``."""
        if len(feats) != 1:
            raise ValueError(f'LiteEncoder takes one map, got {len(feats)}')
        fine = self.input_proj[0](feats[0])                          # (B, C, H, W)
        coarse = self.down1(fine)                                    # (B, C, H/2, W/2)
        coarse = self.gap_fusion(coarse + coarse.mean(dim=(2, 3), keepdim=True))
        out_fine = self.fpn_block(fine + F.interpolate(coarse, scale_factor=2.0,
                                                       mode='nearest'))
        out_coarse = self.pan_block(coarse + self.down2(out_fine))
        return out_fine, out_coarse
