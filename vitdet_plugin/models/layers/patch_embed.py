"""Patch embedding: a strided convolution that turns an image into a token grid, optionally
after a convolutional stem (:class:`ConvStem`)."""
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmcv.cnn import ConvModule
from torch import Tensor, nn

from ...functional.sizes import known_zero, to_2tuple
from ...functional.window import padded_size


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


class PatchEmbed(nn.Module):
    """Image ``(B, C_in, H, W)`` -> tokens ``(B, H', W', C)`` with ``H' = ceil(H / patch)``.

    The image is zero-padded at the bottom/right to a multiple of the patch size (as the
    Swin detection code and mmdet do), so any input size works.

    Args:
        patch_size: patch (and stride) size, int or ``(h, w)``.
        in_chans: input channels.
        embed_dim: output channels.
        norm_layer: optional norm applied to the tokens (``(B, H', W', C)``).
        stem: optional module run on the (padded) image before the projection, e.g. a
            :class:`ConvStem`; it must have ``out_channels`` and an integer
            ``stride`` that divides the patch size, and the projection covers the rest of it.
    """

    def __init__(self,
                 patch_size: Union[int, Tuple[int, int]],
                 in_chans: int,
                 embed_dim: int,
                 norm_layer: Optional[nn.Module] = None,
                 stem: Optional[ConvStem] = None) -> None:
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.in_chans = in_chans
        self.stem = stem
        kernel, proj_in = self.patch_size, in_chans
        if stem is not None:
            stride = stem.stride
            if any(p % stride for p in self.patch_size):
                raise ValueError(f'the stem has stride {stride}, which does not divide the '
                                 f'patch size {self.patch_size}; use a patch size that is a '
                                 f'multiple of {stride} or fewer stem layers')
            kernel = (self.patch_size[0] // stride, self.patch_size[1] // stride)
            proj_in = stem.out_channels
        self.proj = nn.Conv2d(proj_in, embed_dim, kernel_size=kernel, stride=kernel)
        self.norm = norm_layer if norm_layer is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f'expected an image batch of shape (B, C, H, W), got a '
                             f'{x.dim()}-D tensor of shape {tuple(x.shape)}')
        b, c, h, w = x.shape
        if c != self.in_chans:
            raise ValueError(f'input has {c} channels but the model was built with '
                             f'in_channels={self.in_chans}; convert the input or set '
                             f'in_channels={c}')
        if h == 0 or w == 0 or b == 0:
            raise ValueError(f'input has an empty dimension: shape {tuple(x.shape)}; B, H and W '
                             'must be at least 1')
        if not x.is_floating_point():
            raise TypeError(f'input has dtype {x.dtype}; the model takes normalised floating '
                            f'point images: convert with x.float() (and normalise, e.g. with '
                            f"the detector's data_preprocessor)")
        weight_dtype = self.proj.weight.dtype
        if x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f'input dtype {x.dtype} differs from the model dtype '
                            f'{weight_dtype}; convert one of them (x.to({weight_dtype}) or '
                            f'model.to({x.dtype})) or run under torch.autocast')
        ph, pw = self.patch_size
        hp, wp = padded_size((h, w), (ph, pw))  # ceil-div: simple symbolic sizes downstream
        pad_h, pad_w = hp - h, wp - w
        if not known_zero(pad_h, pad_w):  # symbolic sizes always pad (maybe by 0): no guard
            x = F.pad(x, (0, pad_w, 0, pad_h))
        if self.stem is not None:
            x = self.stem(x)
        # a channels-last weight makes the convolution write its output channels-last, so the
        # (B, H, W, C) view below is contiguous: no NCHW -> NHWC reorder of the whole map
        # (on CPU the NCHW output costs oneDNN a reorder of its own: ~4x the conv time)
        weight = self.proj.weight.contiguous(memory_format=torch.channels_last)
        x = F.conv2d(x, weight, self.proj.bias, self.proj.stride).permute(0, 2, 3, 1)
        return self.norm(x)
