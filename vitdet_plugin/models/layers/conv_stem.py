"""Convolutional stem: early strided convolutions before a transformer's patch projection."""
from typing import Optional, Sequence

from mmcv.cnn import ConvModule
from torch import nn


class ConvStem(nn.Sequential):
    """``3x3`` stride-2 convolution + norm + activation per entry of ``channels``.

    Replaces the first ``2 ** len(channels)`` of a patch embedding's stride with overlapping
    convolutions ("Early Convolutions Help Transformers See Better", Xiao et al., 2021): a
    transformer trained from scratch then converges faster and is less sensitive to its
    optimiser settings. ``(B, C_in, H, W)`` -> ``(B, channels[-1], ceil(H / 2^k), ...)``.

    Args:
        in_channels: image channels.
        channels: output channels of each stride-2 convolution.
        norm_cfg, act_cfg: mmcv config dicts for the norm and activation after each conv.
    """

    def __init__(self, in_channels: int, channels: Sequence[int],
                 norm_cfg: Optional[dict] = None, act_cfg: Optional[dict] = None) -> None:
        channels = tuple(int(c) for c in channels)
        if not channels or min(channels) <= 0:
            raise ValueError(f'ConvStem channels must be a non-empty list of positive ints, got '
                             f'{channels!r}')
        norm_cfg = norm_cfg or dict(type='BN')
        act_cfg = act_cfg or dict(type='ReLU')
        layers = []
        for c_in, c_out in zip((in_channels, ) + channels[:-1], channels):
            layers.append(ConvModule(c_in, c_out, 3, stride=2, padding=1, norm_cfg=norm_cfg,
                                     act_cfg=act_cfg))
        super().__init__(*layers)
        self.out_channels: int = channels[-1]
        self.stride: int = 2**len(channels)
