"""Plain ViT backbone for detection (ViTDet; SAM's image encoder).

Li et al., *Exploring Plain Vision Transformer Backbones for Object Detection* (2022): a
non-hierarchical ViT with a 16x16 patch embedding, an absolute position embedding stored at the
pretraining grid and bicubically resized to the input, blocks with window attention (14x14)
except a few global-attention blocks, decomposed relative positions (MViTv2) and optional
residual conv blocks; it outputs the plain stride-16 map of its last block (or of each
``out_indices`` block). Numerically it equals detectron2's ``ViT``, SAM's ``ImageEncoderViT``
trunk and timm's ``VisionTransformerSAM`` blocks. The multi-scale pyramid of ViTDet is a neck,
:class:`~vitdet_plugin.models.necks.ViTSimpleFPN`, chosen in the config as any neck (detectron2:
``SimpleFeaturePyramid(net=ViT(...))``).

Parameter names follow timm / SAM / detectron2 (``patch_embed.proj``, ``pos_embed``,
``blocks.{i}.{norm1, attn.qkv, attn.proj, attn.rel_pos_h, attn.rel_pos_w, norm2, mlp.fc1,
mlp.fc2, residual.*}``); :mod:`vitdet_plugin.weights.vit` converts the checkpoint layouts.
"""
import re
from functools import partial
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Type, Union

import torch
from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...functional import (attend, decomposed_rel_pos_bias, decomposed_rel_pos_channels,
                           from_windows, resize_pos_grid, to_windows, window_pair)
from ...weights.target import CheckpointTarget
from ..accel import check_accel, plan_for_tensor, vit_block_runner
from ..layers import (Attention, ConvStem, DropPath, Mlp, PatchEmbed, ResBottleneckBlock,
                      check_flags, check_rates, linear_drop_path_rates,
                      positive_int, positive_number, to_2tuple)
from .archs import VIT_ARCHS  # noqa: F401  (re-exported)
from .archs import ViTArch, check_frozen_blocks, check_out_indices, index_list
from .base import (TRUNC_NORMAL_STD, BackboneContract, PlainViTFreezing,
                   init_cfg_from_pretrained, init_transformer_weights_, load_init_checkpoint,
                   run_blocks, state_shapes)

if TYPE_CHECKING:
    from ..accel.protocols import ViTBlockParts



class ViTAttention(Attention):
    """Multi-head attention over a ``(B, H, W, C)`` grid with decomposed relative positions.

    The relative-position term rides along as extra query/key channels
    (:func:`~vitdet_plugin.functional.decomposed_rel_pos_channels`), so the fused kernel runs
    without an ``attn_mask`` and no ``(heads, N, N)`` bias is formed or kept, on any device.
    The eager path (``fused=False``) adds the dense bias, the reference formulation.

    Args:
        rel_pos_size: ``(h, w)`` grid the tables are sized for (linearly resized for other
            grids); ``None`` disables relative positions.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True,
                 rel_pos_size: Optional[Tuple[int, int]] = None) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, fused)
        self.use_rel_pos = rel_pos_size is not None
        if rel_pos_size is not None:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_pos_size[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_pos_size[1] - 1, self.head_dim))

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        b, h, w, c = x.shape                                         # (B, H, W, C)
        q, k, v = self.qkv_heads(x.reshape(b, h * w, c))             # (B, heads, HW, d)
        if not self.use_rel_pos:
            out = attend(q, k, v, None, self.dropout_p, self.fused, self.scale)
        elif self.fused:
            q, k, v = decomposed_rel_pos_channels(q, k, v, self.rel_pos_h, self.rel_pos_w,
                                                  (h, w), self.scale)  # (B, heads, HW, d')
            out = attend(q, k, v, None, self.dropout_p, scale=1.0)[..., :self.head_dim]
        else:
            bias = decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (h, w), (h, w))
            out = attend(q, k, v, bias, self.dropout_p, False, self.scale)
        out = out.transpose(1, 2).reshape(b, h, w, c)                # (B, H, W, C)
        return self.proj_drop(self.proj(out))


class ViTBlock(nn.Module):
    """Pre-norm transformer block on ``(B, H, W, C)`` with window or global attention.

    Args:
        window_size: ``(wh, ww)`` for window attention (the map is zero-padded at the
            bottom/right to whole windows and cropped back), ``None`` for global attention.
        rel_pos_size: grid of the relative-position tables (the window, or the full grid the
            global blocks were built for); ``None`` disables relative positions.
        residual: append a residual bottleneck conv block (detectron2
            ``residual_block_indexes``).
    """

    def __init__(self, dim: int, num_heads: int, window_size: Optional[Tuple[int, int]],
                 rel_pos_size: Optional[Tuple[int, int]], mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None, residual: bool = False,
                 fused_attn: bool = True) -> None:
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN', eps=1e-6)
        act_layer = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.window_size = window_size
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.attn = ViTAttention(dim, num_heads, qkv_bias, attn_drop, drop, fused_attn,
                                 rel_pos_size)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        self.residual = ResBottleneckBlock(dim, dim // 2, act_layer) if residual else None

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        x = x + self.drop_path(self.attention(self.norm1(x)))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return self.residual_conv(x)

    def attention(self, x: Tensor) -> Tensor:
        """Window attention (zero-padded to whole windows, no shift) or global attention of
        the normalised map ``(B, H, W, C)``."""
        if self.window_size is None:
            return self.attn(x)
        windows, grid = to_windows(x, self.window_size)             # (B * nW, N, C)
        windows = self.attn(windows.view(-1, *self.window_size, x.shape[-1]))  # (.., wh, ww, C)
        return from_windows(windows.flatten(1, 2), grid)            # (B, H, W, C)

    def residual_conv(self, x: Tensor) -> Tensor:
        """The residual bottleneck conv block, if any, on ``(B, H, W, C)`` via NCHW."""
        if self.residual is None:
            return x
        return self.residual(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}'


if TYPE_CHECKING:  # the block has what the accel runner reads (mypy checks it here)
    _VIT_BLOCK: Type[ViTBlockParts] = ViTBlock


@MODELS.register_module()
class ViTBackbone(PlainViTFreezing, BackboneContract, BaseModule):
    """Plain ViT (ViTDet) with window attention, global blocks and decomposed rel-pos.

    Args:
        arch: preset ``'base'`` / ``'large'`` / ``'huge'`` (ViTDet: embed 768/1024/1280, depth
            12/24/32, heads 12/16/16, global blocks [2,5,8,11]/[5,11,17,23]/[7,15,23,31],
            drop path 0.1/0.4/0.5) or a dict with ``embed_dims``, ``depth``, ``num_heads``
            (and optionally ``global_attn_indexes``, ``drop_path_rate``); arguments given
            directly override it.
        global_attn_indexes: blocks with global attention; all others use window attention.
        stem_channels: optional convolutional stem (:class:`~..layers.ConvStem`, one ``3x3``
            stride-2 conv per entry) before a ``patch_size / 2^k`` projection, for training
            from scratch (not in pretrained checkpoints); ``()``: the plain patch projection.
        stem_norm_cfg: norm config of the stem's convolutions (default BN).
        window_size: attention window (int or ``(h, w)``) of the window blocks.
        img_size: input size the global blocks' relative-position tables are sized for
            (``img_size / patch_size`` per axis; tables are resized for other inputs).
        pretrain_img_size: image size of the stored absolute position grid.
        pretrain_use_cls_token: the stored position embedding has a leading cls slot (MAE /
            timm / detectron2 layout); it is not used in the forward pass.
        use_abs_pos, use_rel_pos: absolute position embedding; decomposed relative positions.
        residual_block_indexes: blocks followed by a residual bottleneck conv block.
        out_indices: blocks whose outputs are returned (default: the last block).
        frozen_stages: ``-1`` trains everything; ``0`` freezes the patch and position
            embeddings; ``k >= 1`` also the first ``k`` blocks.
        with_cp: activation checkpointing per block (non-reentrant).
        fused_attn: attention through ``F.scaled_dot_product_attention`` (False: eager).
        accel: ``'auto'`` (default): on the CPU, training MLPs recompute their GELU in
            backward; ``'off'``: the plain path everywhere (see :mod:`..accel`).
        pyramid: no longer accepted (the simple pyramid is the neck ``ViTSimpleFPN``); giving
            it raises an error that spells out the equivalent ``neck`` config.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads timm ViT / DeiT / MAE,
            SAM, timm ``samvit``, detectron2 ViTDet or our own checkpoints (format detected,
            ``weights_only=True``, strict with a report).
    """

    NO_DECAY_PARAMS = ('pos_embed', 'rel_pos_h', 'rel_pos_w')

    def __init__(self,
                 arch: Union[str, dict, None] = 'base',
                 embed_dims: Optional[int] = None,
                 depth: Optional[int] = None,
                 num_heads: Optional[int] = None,
                 global_attn_indexes: Optional[Sequence[int]] = None,
                 drop_path_rate: Optional[float] = None,
                 in_channels: int = 3,
                 patch_size: int = 16,
                 stem_channels: Sequence[int] = (),
                 stem_norm_cfg: Optional[dict] = None,
                 window_size: Union[int, Tuple[int, int]] = 14,
                 img_size: Union[int, Tuple[int, int]] = 1024,
                 pretrain_img_size: Union[int, Tuple[int, int]] = 224,
                 pretrain_use_cls_token: bool = True,
                 use_abs_pos: bool = True,
                 use_rel_pos: bool = True,
                 mlp_ratio: float = 4.0,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 residual_block_indexes: Sequence[int] = (),
                 out_indices: Sequence[int] = (-1,),
                 frozen_stages: int = -1,
                 with_cp: bool = False,
                 fused_attn: bool = True,
                 accel: str = 'auto',
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pyramid: Union[bool, dict, None] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        spec = ViTArch.resolve(arch, embed_dims=embed_dims, depth=depth, num_heads=num_heads,
                               global_attn_indexes=global_attn_indexes,
                               drop_path_rate=drop_path_rate)
        self.embed_dims, self.depth, self.num_heads = spec.embed_dims, spec.depth, spec.num_heads
        self.global_attn_indexes: Tuple[int, ...] = spec.global_attn_indexes or ()
        self.residual_block_indexes = index_list('residual_block_indexes',
                                                  residual_block_indexes, self.depth)
        if pyramid:
            raise ValueError(_pyramid_moved_message(pyramid, self.embed_dims, patch_size))
        self.window_size = window_pair(window_size, 'window_size', '; for global attention in '
                                       'every block list all blocks in global_attn_indexes')
        self.patch_size = positive_int(patch_size, 'patch_size')
        self.in_channels = positive_int(in_channels, 'in_channels')
        self.out_indices = check_out_indices(out_indices, self.depth)
        check_frozen_blocks(frozen_stages, self.depth, 'patch/position embeddings')
        positive_number(mlp_ratio, 'mlp_ratio')
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate)
        check_flags(pretrain_use_cls_token=pretrain_use_cls_token, use_abs_pos=use_abs_pos,
                    use_rel_pos=use_rel_pos, qkv_bias=qkv_bias, with_cp=with_cp,
                    fused_attn=fused_attn)
        self.accel = check_accel(accel)
        self.frozen_stages = frozen_stages
        self.with_cp = with_cp
        for name, size in (('img_size', img_size), ('pretrain_img_size', pretrain_img_size)):
            if min(to_2tuple(size, name)) < patch_size:
                raise ValueError(f'{name}={size!r} is smaller than patch_size={patch_size}: '
                                 f'the grid it describes would be empty; give the image size '
                                 f'(at least one patch per side)')

        stem = ConvStem(in_channels, stem_channels, stem_norm_cfg) if len(stem_channels) else None
        self.patch_embed = PatchEmbed(patch_size, in_channels, self.embed_dims, stem=stem)
        self.pretrain_grid = tuple(s // patch_size for s in to_2tuple(pretrain_img_size))
        self.num_pos_prefix = int(pretrain_use_cls_token)
        if use_abs_pos:
            n = self.pretrain_grid[0] * self.pretrain_grid[1] + self.num_pos_prefix
            self.pos_embed: Optional[nn.Parameter] = nn.Parameter(
                torch.zeros(1, n, self.embed_dims))
        else:
            self.register_parameter('pos_embed', None)

        img_h, img_w = to_2tuple(img_size, 'img_size')
        full_grid = (img_h // patch_size, img_w // patch_size)
        rates = linear_drop_path_rates(spec.drop_path_rate, self.depth)
        self.blocks = nn.ModuleList()
        for i in range(self.depth):
            is_global = i in self.global_attn_indexes
            rel_size = (full_grid if is_global else self.window_size) if use_rel_pos else None
            self.blocks.append(ViTBlock(
                self.embed_dims, self.num_heads, None if is_global else self.window_size,
                rel_size, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], norm_cfg,
                act_cfg, i in self.residual_block_indexes, fused_attn))

        self.out_channels = (self.embed_dims,) * len(self.out_indices)
        self.out_strides = (patch_size,) * len(self.out_indices)
        self.num_layers = self.depth
        self._init_vit_weights()
        self._freeze_stages()

    # ------------------------------------------------------------------ contract
    def layer_id(self, name: str) -> int:
        """detectron2's rule: embeddings 0, block ``i`` ``i + 1``; residual conv blocks and
        everything else ``num_layers + 1``."""
        if name.startswith(('patch_embed.', 'pos_embed', 'cls_token')):
            return 0
        m = re.match(r'^blocks\.(\d+)\.', name)
        if m and '.residual.' not in name:
            return int(m.group(1)) + 1
        return self.num_layers + 1

    # ------------------------------------------------------------------ weights
    def _init_vit_weights(self) -> None:
        """detectron2's ViT init: trunc-normal(0.02) position embedding and linears."""
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=TRUNC_NORMAL_STD)
        init_transformer_weights_(self.blocks)
        for m in self.blocks.modules():  # MSRA convs, zero last norm: identity at init
            if isinstance(m, ResBottleneckBlock):
                m.reset_parameters()

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a ViT checkpoint for."""
        gh, gw = self.pretrain_grid
        return CheckpointTarget('ViT', type(self).__name__, state_shapes(self), pos_grid=(gh, gw))

    def init_weights(self) -> None:
        """Load ``init_cfg.checkpoint`` (any supported layout) or keep the constructor init."""
        if not load_init_checkpoint(self):
            super().init_weights()

    # ------------------------------------------------------------------ freezing
    def frozen_parameters(self) -> List[nn.Parameter]:
        if self.frozen_stages >= 0 and self.pos_embed is not None:
            return [self.pos_embed]
        return []

    # ------------------------------------------------------------------ forward
    def abs_pos_embed(self, hw: Tuple[int, int]) -> Tensor:
        """The position embedding for an ``hw`` token grid, ``(1, h, w, C)`` (bicubic resize
        of the stored grid)."""
        assert self.pos_embed is not None, 'built with use_abs_pos=False'
        gh, gw = self.pretrain_grid
        grid = self.pos_embed[:, self.num_pos_prefix:].reshape(1, gh, gw, -1)  # (1, gh, gw, C)
        return resize_pos_grid(grid.permute(0, 3, 1, 2), hw).permute(0, 2, 3, 1)

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> ``(B, C, ceil(H / 16), ceil(W / 16))`` per output index (at
        :attr:`out_strides`, the patch size)."""
        x = self.patch_embed(x)                                      # (B, h, w, C)
        if self.pos_embed is not None:
            x = x + self.abs_pos_embed((x.shape[1], x.shape[2]))
        outs = []
        run = vit_block_runner(plan_for_tensor(x, self.accel))      # accel, once per forward
        start = 0
        for end in self.out_indices:  # sorted: the blocks up to each output, in turn
            x = run_blocks(self.blocks[start:end + 1], x, self.with_cp, self.training, run)
            outs.append(x.permute(0, 3, 1, 2).contiguous())        # (B, C, h, w)
            start = end + 1
        return tuple(outs)


def _pyramid_moved_message(pyramid: Union[bool, dict], embed_dims: int, patch_size: int) -> str:
    """The error for the removed ``pyramid`` argument, with the ``neck`` config that builds the
    same pyramid (the in-backbone pyramid had no extra max-pooled level)."""
    cfg = dict(pyramid) if isinstance(pyramid, dict) else {}
    cfg.pop('type', None)
    scales = tuple(cfg.pop('scale_factors', (4.0, 2.0, 1.0, 0.5)))
    neck = dict(type='ViTSimpleFPN', in_channels=embed_dims, in_stride=patch_size,
                scale_factors=scales, num_outs=len(scales), **cfg)
    return (f'ViTBackbone(pyramid={pyramid!r}): the backbone no longer builds the simple '
            f'feature pyramid, it is the neck ViTSimpleFPN; remove pyramid and set '
            f'model.neck={neck!r} (the heads keep their in_channels)')
