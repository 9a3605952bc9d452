"""Conv + BatchNorm blocks of the real-time DETRs (RT-DETR, D-FINE, DEIMv2): one copy each,
shared by the HGNetV2 backbone, DEIMv2's spatial tuning adapter and the hybrid / lite encoders.

* :class:`ConvNorm`: ``conv (no bias) -> BatchNorm -> activation``, ``(k - 1) // 2`` padding;
* :class:`RepVGGBlock`: a 3x3 and a 1x1 :class:`ConvNorm` summed, then the activation
  (the training form; RepVGG's fused deploy form is one 3x3 conv);
* :class:`CSPRepLayer`: a CSP layer of RepVGG blocks, in D-FINE's form (``'csp'``: two 1x1
  convs, one through the blocks) or DEIMv2's (``'csp2'``: one 1x1 conv split in halves);
* :class:`RepNCSPELAN`: the CSP-ELAN fusion block of the encoders (D-FINE's RepNCSPELAN4 with a
  3x3 conv after each CSP branch, DEIMv2's RepNCSPELAN5 without);
* :class:`SCDown`: a 1x1 conv then a depthwise strided conv (YOLOv10's spatial-channel
  decoupled downsampling).
"""
from typing import Mapping, Optional, Type

import torch
from torch import Tensor, nn

#: Activations by the names the reference configs use (exact GELU, as ``nn.GELU()``).
ACTIVATIONS: Mapping[str, Type[nn.Module]] = {'relu': nn.ReLU, 'silu': nn.SiLU, 'gelu': nn.GELU}
#: CSP layer forms: D-FINE's two 1x1 convs, DEIMv2's one split 1x1 conv.
CSP_TYPES = ('csp', 'csp2')
#: BatchNorm eps of every block (PyTorch's default, the references' too).
BN_EPS = 1e-5


def make_activation(act: Optional[str]) -> nn.Module:
    """The activation named ``act`` (:data:`ACTIVATIONS`), ``nn.Identity`` for None."""
    if act is None:
        return nn.Identity()
    if act not in ACTIVATIONS:
        raise ValueError(f'activation {act!r} is not one of {sorted(ACTIVATIONS)} (or None)')
    return ACTIVATIONS[act]()


class ConvNorm(nn.Module):
    """``conv (no bias) -> BatchNorm -> act`` with ``(kernel - 1) // 2`` padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 1,
                 stride: int = 1, groups: int = 1, act: Optional[str] = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                              padding=(kernel_size - 1) // 2, groups=groups, bias=False)
        self.norm = nn.BatchNorm2d(out_channels, eps=BN_EPS)
        self.act = make_activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.norm(self.conv(x)))


class RepVGGBlock(nn.Module):
    """``act(conv3x3(x) + conv1x1(x))``, both conv + BatchNorm without activation."""

    def __init__(self, channels: int, act: Optional[str]) -> None:
        super().__init__()
        self.conv1 = ConvNorm(channels, channels, 3)
        self.conv2 = ConvNorm(channels, channels, 1)
        self.act = make_activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.conv1(x) + self.conv2(x))


class CSPRepLayer(nn.Module):
    """A CSP layer of ``num_blocks`` :class:`RepVGGBlock`: one path through the blocks, one
    shortcut path, summed. ``csp_type='csp'`` (D-FINE) projects each path with its own 1x1
    conv; ``'csp2'`` (DEIMv2) projects once to twice the width and splits."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int,
                 act: Optional[str], csp_type: str = 'csp') -> None:
        super().__init__()
        if csp_type not in CSP_TYPES:
            raise ValueError(f'csp_type={csp_type!r} is not one of {list(CSP_TYPES)} '
                             "('csp': D-FINE's two 1x1 convs, 'csp2': DEIMv2's split one)")
        self.csp_type = csp_type
        self.conv1 = ConvNorm(in_channels, out_channels * (2 if csp_type == 'csp2' else 1),
                              act=act)
        self.conv2 = ConvNorm(in_channels, out_channels, act=act) if csp_type == 'csp' else None
        self.bottlenecks = nn.Sequential(*(RepVGGBlock(out_channels, act)
                                           for _ in range(num_blocks)))

    def forward(self, x: Tensor) -> Tensor:
        if self.conv2 is None:                                       # csp2
            shortcut, y = self.conv1(x).chunk(2, dim=1)              # 2 x (B, C, H, W)
        else:
            y, shortcut = self.conv1(x), self.conv2(x)               # 2 x (B, C, H, W)
        return self.bottlenecks(y) + shortcut


class ELANBranch(nn.Module):
    """One branch of :class:`RepNCSPELAN`: a :class:`CSPRepLayer`, then (RepNCSPELAN4) a 3x3
    :class:`ConvNorm`."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int,
                 act: Optional[str], csp_type: str, branch_conv: bool) -> None:
        super().__init__()
        self.csp = CSPRepLayer(in_channels, out_channels, num_blocks, act, csp_type)
        self.conv = ConvNorm(out_channels, out_channels, 3, act=act) if branch_conv else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.csp(x)
        return x if self.conv is None else self.conv(x)


class RepNCSPELAN(nn.Module):
    """CSP-ELAN fusion: a 1x1 conv to ``split_channels`` split in halves, two chained
    :class:`ELANBranch` on the second half, all four maps concatenated and fused by a 1x1 conv.

    Args:
        in_channels, out_channels: the block's input and output widths.
        split_channels: width of the first 1x1 conv (two halves).
        branch_channels: width of each branch.
        num_blocks: RepVGG blocks per CSP layer.
        act: activation of every conv but the RepVGG branches'.
        csp_type: :class:`CSPRepLayer`'s form.
        branch_conv: a 3x3 conv after each CSP layer (D-FINE's RepNCSPELAN4; DEIMv2's
            RepNCSPELAN5 has none).
    """

    def __init__(self, in_channels: int, out_channels: int, split_channels: int,
                 branch_channels: int, num_blocks: int, act: Optional[str] = 'silu',
                 csp_type: str = 'csp', branch_conv: bool = True) -> None:
        super().__init__()
        if split_channels % 2:
            raise ValueError(f'split_channels={split_channels} must be even (two halves)')
        half = split_channels // 2
        self.conv_in = ConvNorm(in_channels, split_channels, act=act)
        self.branches = nn.ModuleList([
            ELANBranch(half, branch_channels, num_blocks, act, csp_type, branch_conv),
            ELANBranch(branch_channels, branch_channels, num_blocks, act, csp_type,
                       branch_conv)])
        self.conv_out = ConvNorm(split_channels + 2 * branch_channels, out_channels, act=act)

    def forward(self, x: Tensor) -> Tensor:
        parts = list(self.conv_in(x).chunk(2, dim=1))                # 2 x (B, split / 2, H, W)
        for branch in self.branches:
            parts.append(branch(parts[-1]))                          # (B, branch, H, W)
        return self.conv_out(torch.cat(parts, dim=1))                # (B, out, H, W)


class SCDown(nn.Module):
    """A 1x1 conv then a depthwise ``kernel_size`` conv of ``stride``, both without
    activation."""

    def __init__(self, channels: int, kernel_size: int = 3, stride: int = 2) -> None:
        super().__init__()
        self.conv1 = ConvNorm(channels, channels, 1)
        self.conv2 = ConvNorm(channels, channels, kernel_size, stride, groups=channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.conv1(x))
