"""Plain ViT backbone for detection (ViTDet; SAM's image encoder).

Li et al., *Exploring Plain Vision Transformer Backbones for Object Detection* (2022): the plain
ViT (:class:`~.plain_vit.PlainViTBackbone`) with window attention (14x14) except a few global
blocks, decomposed relative positions (MViTv2) and optional residual conv blocks after chosen
blocks; both extras are this module's, plugged into the shared blocks by :func:`vitdet_blocks`.
Numerically it equals detectron2's ``ViT``, SAM's ``ImageEncoderViT`` trunk and timm's
``VisionTransformerSAM`` blocks. The multi-scale pyramid is the neck
:class:`~vitdet_plugin.models.necks.ViTSimpleFPN`. Parameter names follow timm / SAM /
detectron2 (``blocks.{i}.{norm1, attn.qkv, attn.proj, attn.rel_pos_h, attn.rel_pos_w, norm2,
mlp.fc1, mlp.fc2, residual.*}``).
"""
import dataclasses
from functools import partial
from typing import Any, ClassVar, Optional, Sequence, Tuple, Union

import torch
from mmcv.cnn import build_activation_layer
from mmdet.registry import MODELS
from torch import Tensor, nn

from ...functional.attention import attend
from ...functional.decomposed_rel_pos import decomposed_rel_pos_bias, decomposed_rel_pos_channels
from ..layers.arguments import check_flag, check_flags, positive_int, refuse_removed
from ..layers.res_bottleneck import ResBottleneckBlock
from .base import load_init_checkpoint
from .plain_vit import BlockFactory, PlainViTBackbone, family_docs, patch_grid
from .vit_archs import PlainViTArch, index_list
from .vit_block import TokenLayout, ViTAttention, ViTBlock

__all__ = ['VIT_ARCHS', 'ViTArch', 'ViTBackbone']


@dataclasses.dataclass(frozen=True)
class ViTArch(PlainViTArch):
    """ViTDet presets (detectron2 projects/ViTDet): GELU MLP, fused qkv bias, decomposed
    relative positions (``rel_pos``) in every block, residual bottleneck conv blocks after the
    ``residual_block_indexes``; custom arch dicts default to global attention in the last block
    of each quarter and no drop path."""

    rel_pos: bool = True
    residual_block_indexes: Tuple[int, ...] = ()

    NAME: ClassVar[str] = 'ViT'
    PRESETS: ClassVar = {
        'base': dict(embed_dims=768, depth=12, num_heads=12, global_attn_indexes=(2, 5, 8, 11),
                     drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16,
                      global_attn_indexes=(5, 11, 17, 23), drop_path_rate=0.4),
        'huge': dict(embed_dims=1280, depth=32, num_heads=16,
                     global_attn_indexes=(7, 15, 23, 31), drop_path_rate=0.5),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag(self.rel_pos, 'rel_pos')
        object.__setattr__(self, 'residual_block_indexes',
                           index_list('residual_block_indexes', self.residual_block_indexes,
                                      self.depth))


#: The ViTDet presets.
VIT_ARCHS = ViTArch.PRESETS


class RelPosAttention(ViTAttention):
    """:class:`ViTAttention` with decomposed relative positions (``rel_pos_h``, ``rel_pos_w``)
    on a patch grid without prefix tokens; tables sized for ``rel_pos_size``, linearly resized
    for other grids. The fused kernel gets them as extra query / key channels
    (:func:`~vitdet_plugin.functional.decomposed_rel_pos_channels`: no ``attn_mask``, no
    ``(heads, N, N)`` bias kept); the eager formula adds the dense bias."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: str = 'qkv', attn_drop: float = 0.0,
                 proj_drop: float = 0.0, sub_ln_eps: Optional[float] = None,
                 rotate_half: bool = False, *, rel_pos_size: Tuple[int, int]) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, sub_ln_eps, rotate_half)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_pos_size[0] - 1, self.head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_pos_size[1] - 1, self.head_dim))

    def attend_heads(self, q: Tensor, k: Tensor, v: Tensor, grid: Tuple[int, int]) -> Tensor:
        if self.fused:
            q, k, v = decomposed_rel_pos_channels(q, k, v, self.rel_pos_h, self.rel_pos_w, grid,
                                                  self.scale)        # (B', heads, N, d')
            return attend(q, k, v, None, self.dropout_p, scale=1.0)[..., :self.head_dim]
        bias = decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, grid, grid)
        return attend(q, k, v, bias, self.dropout_p, False, self.scale)


class ViTDetBlock(ViTBlock):
    """:class:`ViTBlock` (no prefix tokens) with :class:`RelPosAttention` when
    ``rel_pos_size`` is given, then a residual bottleneck conv block on the patch map if
    ``residual`` (detectron2 ``residual_block_indexes``)."""

    def __init__(self, rel_pos_size: Optional[Tuple[int, int]], residual: bool,
                 **block_args: Any) -> None:
        attention = (ViTAttention if rel_pos_size is None
                     else partial(RelPosAttention, rel_pos_size=rel_pos_size))
        super().__init__(attention=attention, **block_args)
        dim = block_args['spec'].embed_dims
        act_layer = partial(build_activation_layer, block_args.get('act_cfg') or
                            dict(type='GELU'))
        self.residual = ResBottleneckBlock(dim, dim // 2, act_layer) if residual else None

    def forward(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """``(B, h * w, C)`` -> the same."""
        x = super().forward(x, layout)
        if self.residual is None:
            return x
        (h, w), (b, _, c) = layout.grid, x.shape
        patches = x.transpose(1, 2).reshape(b, c, h, w)              # (B, C, h, w)
        return self.residual(patches).flatten(2).transpose(1, 2)     # (B, h * w, C)


def vitdet_blocks(spec: ViTArch, full_grid: Optional[Tuple[int, int]]) -> BlockFactory:
    """ViTDet's blocks: relative positions (``spec.rel_pos``) sized for the window, or for
    ``full_grid`` in the global blocks; residual conv blocks after ``residual_block_indexes``."""
    def make_block(index: int, window_size: Optional[Tuple[int, int]],
                   **block_args: Any) -> ViTDetBlock:
        rel_pos_size = (window_size or full_grid) if spec.rel_pos else None
        return ViTDetBlock(rel_pos_size, index in spec.residual_block_indexes,
                           window_size=window_size, **block_args)
    return make_block


@MODELS.register_module()
@family_docs
class ViTBackbone(PlainViTBackbone):
    """Plain ViT (ViTDet) with window attention, global blocks and decomposed rel-pos.

    The arguments are :class:`~.plain_vit.PlainViTBackbone`'s (below) with ViTDet's defaults
    (no cls / register tokens, no final norm, plain bicubic position resizing), and:

    Args:
        arch: preset ``'base'`` / ``'large'`` / ``'huge'`` or a dict of :class:`ViTArch`
            fields; arguments given directly override it.
        img_size: input size the global blocks' relative-position tables are sized for
            (``img_size / patch_size`` per axis; resized for other inputs).
        pretrain_img_size: image size of the stored position grid (at ``patch_size``).
        use_rel_pos: decomposed relative positions; qkv_bias: a bias on the fused ``qkv``.
        residual_block_indexes: blocks followed by a residual bottleneck conv block.
        pyramid: no longer accepted (the simple pyramid is the neck ``ViTSimpleFPN``); the
            error spells out the equivalent ``neck`` config.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads timm ViT / DeiT / MAE,
            SAM, timm ``samvit``, detectron2 ViTDet or our own checkpoints.
    """

    ARCH = ViTArch
    FAMILY = 'ViT'
    POS_ANTIALIAS = False
    FINAL_NORM = False
    NO_DECAY_PARAMS = PlainViTBackbone.NO_DECAY_PARAMS + ('rel_pos_h', 'rel_pos_w')

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
                 img_size: Union[int, Tuple[int, int], None] = 1024,
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
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pyramid: Union[bool, dict, None] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None,
                 **removed: object) -> None:
        name = type(self).__name__
        refuse_removed(name, removed)
        check_flags(pretrain_use_cls_token=pretrain_use_cls_token, use_abs_pos=use_abs_pos,
                    use_rel_pos=use_rel_pos, qkv_bias=qkv_bias)
        spec = ViTArch.resolve(
            arch, embed_dims=embed_dims, depth=depth, num_heads=num_heads,
            global_attn_indexes=global_attn_indexes, drop_path_rate=drop_path_rate,
            mlp_ratio=mlp_ratio, qkv_bias='qkv' if qkv_bias else 'none', rel_pos=use_rel_pos,
            residual_block_indexes=residual_block_indexes)
        if pyramid:
            raise ValueError(_pyramid_moved_message(pyramid, spec.embed_dims, patch_size))
        full_grid = None if img_size is None else patch_grid(
            img_size, 'img_size', positive_int(patch_size, 'patch_size'))
        if spec.rel_pos and full_grid is None and spec.global_attn_indexes:
            raise ValueError(f'{name}(use_rel_pos=True) needs img_size, the input size the '
                             "global blocks' relative-position tables are sized for")
        super().__init__(
            spec, in_channels=in_channels, patch_size=patch_size, stem_channels=stem_channels,
            stem_norm_cfg=stem_norm_cfg, window_size=window_size,
            pretrain_img_size=pretrain_img_size if use_abs_pos else None,
            pretrain_patch_size=patch_size if use_abs_pos else None,
            pretrain_use_cls_token=pretrain_use_cls_token, use_abs_pos=use_abs_pos, rope=None,
            prefix_tokens='drop', out_indices=out_indices, drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate, frozen_stages=frozen_stages, with_cp=with_cp,
            norm_cfg=norm_cfg, act_cfg=act_cfg, pretrained=pretrained, init_cfg=init_cfg,
            make_block=vitdet_blocks(spec, full_grid))

    def layer_id(self, name: str) -> int:
        """The plain ViT's, but residual conv blocks are new layers (detectron2's rule):
        ``num_layers + 1``."""
        return self.num_layers + 1 if '.residual.' in name else super().layer_id(name)

    def init_weights(self) -> None:
        """The plain ViT's; a random init also makes each residual conv block the identity
        (MSRA convs, zero last norm), as detectron2."""
        if load_init_checkpoint(self):
            return
        super().init_weights()  # the random init (no checkpoint to load)
        for m in self.blocks.modules():
            if isinstance(m, ResBottleneckBlock):
                m.reset_parameters()


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
