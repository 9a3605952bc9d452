"""Residual bottleneck conv block on NCHW maps (detectron2 ViTDet's ``ResBottleneckBlock``)."""
from typing import Callable, Optional, cast

from torch import Tensor, nn

from .norm import LayerNorm2d

#: detectron2's LayerNorm (channels-first) epsilon.
LN2D_EPS = 1e-6


class ResBottleneckBlock(nn.Module):
    """``x + norm3(conv3(act(norm2(conv2(act(norm1(conv1(x))))))))`` on ``(B, C, H, W)``.

    ``conv1`` 1x1 to ``bottleneck_channels``, ``conv2`` 3x3, ``conv3`` 1x1 back to
    ``channels``; no conv biases, channel LayerNorms, MSRA init and a zero-initialised last norm
    so a freshly added block starts as the identity. Parameter names match detectron2
    (``conv1``, ``norm1``, ``conv2``, ``norm2``, ``conv3``, ``norm3``).

    Args:
        channels: input and output channels.
        bottleneck_channels: inner channels (detectron2 uses ``channels // 2``).
        act_layer: activation constructor (called with no arguments).
        norm_layer: norm constructor ``f(num_channels) -> module`` for NCHW maps; defaults to
            :class:`LayerNorm2d` with eps ``1e-6``.
    """

    def __init__(self, channels: int, bottleneck_channels: Optional[int] = None,
                 act_layer: Callable[[], nn.Module] = nn.GELU,
                 norm_layer: Optional[Callable[[int], nn.Module]] = None) -> None:
        super().__init__()
        bottleneck_channels = bottleneck_channels or channels // 2
        if bottleneck_channels <= 0:
            raise ValueError(f'bottleneck_channels must be positive, got {bottleneck_channels}')
        norm_layer = norm_layer or (lambda c: LayerNorm2d(c, eps=LN2D_EPS))
        self.conv1 = nn.Conv2d(channels, bottleneck_channels, 1, bias=False)
        self.norm1 = norm_layer(bottleneck_channels)
        self.act1 = act_layer()
        self.conv2 = nn.Conv2d(bottleneck_channels, bottleneck_channels, 3, padding=1,
                               bias=False)
        self.norm2 = norm_layer(bottleneck_channels)
        self.act2 = act_layer()
        self.conv3 = nn.Conv2d(bottleneck_channels, channels, 1, bias=False)
        self.norm3 = norm_layer(channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """MSRA (fan-out) conv init, unit norms, and a zero last norm (identity block)."""
        for conv in (self.conv1, self.conv2, self.conv3):
            nn.init.kaiming_normal_(conv.weight, mode='fan_out', nonlinearity='relu')
        for norm, scale in ((self.norm1, 1.0), (self.norm2, 1.0), (self.norm3, 0.0)):
            nn.init.constant_(cast(Tensor, norm.weight), scale)
            nn.init.zeros_(cast(Tensor, norm.bias))

    def forward(self, x: Tensor) -> Tensor:
        out = self.act1(self.norm1(self.conv1(x)))
        out = self.act2(self.norm2(self.conv2(out)))
        return x + self.norm3(self.conv3(out))
