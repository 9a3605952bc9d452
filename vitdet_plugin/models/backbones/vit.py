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

It is a preset of the one plain ViT (:class:`~.plain_vit.PlainViTBackbone`: the block, the
position embedding and the forward are that module's) with ViTDet's arguments. Parameter names
follow timm / SAM / detectron2 (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1,
attn.qkv, attn.proj, attn.rel_pos_h, attn.rel_pos_w, norm2, mlp.fc1, mlp.fc2, residual.*}``);
:mod:`vitdet_plugin.weights.vit` converts the checkpoint layouts.
"""
from typing import Optional, Sequence, Tuple, Union

from mmdet.registry import MODELS

from ..layers.arguments import check_flags, refuse_removed
from .plain_vit import PlainViTBackbone
from .vit_archs import VIT_ARCHS, ViTArch

__all__ = ['VIT_ARCHS', 'ViTBackbone']

@MODELS.register_module()
class ViTBackbone(PlainViTBackbone):
    """Plain ViT (ViTDet) with window attention, global blocks and decomposed rel-pos.

    The arguments are :class:`~.plain_vit.PlainViTBackbone`'s in ViTDet's form:

    Args:
        arch: preset ``'base'`` / ``'large'`` / ``'huge'`` (ViTDet: embed 768/1024/1280, depth
            12/24/32, heads 12/16/16, global blocks [2,5,8,11]/[5,11,17,23]/[7,15,23,31],
            drop path 0.1/0.4/0.5) or a dict of :class:`~.vit_archs.ViTArch` fields; arguments
            given directly override it.
        embed_dims, depth, num_heads, global_attn_indexes, drop_path_rate, mlp_ratio: override
            the preset's fields.
        in_channels: image channels.
        patch_size: patch embedding stride (the output stride).
        window_size: the window of the window-attention blocks.
        out_indices: blocks whose outputs are returned (``(-1,)``: the last).
        drop_rate, attn_drop_rate: dropout after the projections / on the attention weights.
        frozen_stages: ``-1`` trains all; ``0`` freezes the embeddings; ``k`` also the first
            ``k`` blocks.
        with_cp: activation checkpointing per block.
        stem_channels: optional convolutional stem for training from scratch (not in
            pretrained checkpoints); ``stem_norm_cfg``: its norms (default BN).
        img_size: input size the global blocks' relative-position tables are sized for
            (``img_size / patch_size`` per axis; tables are resized for other inputs).
        pretrain_img_size: image size of the stored absolute position grid (at ``patch_size``).
        pretrain_use_cls_token: the stored position embedding has a leading cls slot (MAE /
            timm / detectron2 layout); it is not used in the forward pass (no cls token).
        use_abs_pos, use_rel_pos: absolute position embedding; decomposed relative positions.
        qkv_bias: a bias on the fused ``qkv`` projection.
        residual_block_indexes: blocks followed by a residual bottleneck conv block.
        norm_cfg, act_cfg: the blocks' norms (default LN, eps 1e-6) and MLP activation.
        pretrained: deprecated mmdet spelling of ``init_cfg=dict(type='Pretrained',
            checkpoint=...)``.
        pyramid: no longer accepted (the simple pyramid is the neck ``ViTSimpleFPN``); giving
            it raises an error that spells out the equivalent ``neck`` config.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads timm ViT / DeiT / MAE,
            SAM, timm ``samvit``, detectron2 ViTDet or our own checkpoints (format detected,
            ``weights_only=True``, strict with a report).
        removed: options removed with the CPU kernels (``accel``, ``fused_attn``): an error
            names what replaces them.
    """

    ARCH = ViTArch
    FAMILY = 'ViT'
    POS_ANTIALIAS = False
    FINAL_NORM = False

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
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pyramid: Union[bool, dict, None] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None,
                 **removed: object) -> None:
        refuse_removed(type(self).__name__, removed)
        check_flags(pretrain_use_cls_token=pretrain_use_cls_token, use_abs_pos=use_abs_pos,
                    use_rel_pos=use_rel_pos, qkv_bias=qkv_bias)
        if pyramid:
            dims = ViTArch.resolve(arch, embed_dims=embed_dims, depth=depth,
                                   num_heads=num_heads).embed_dims
            raise ValueError(_pyramid_moved_message(pyramid, dims, patch_size))
        super().__init__(
            arch, embed_dims, depth, num_heads, global_attn_indexes, drop_path_rate,
            qkv_bias='qkv' if qkv_bias else 'none', mlp_ratio=mlp_ratio,
            use_rel_pos=use_rel_pos, residual_block_indexes=residual_block_indexes,
            in_channels=in_channels, patch_size=patch_size, stem_channels=stem_channels,
            stem_norm_cfg=stem_norm_cfg, window_size=window_size, img_size=img_size,
            pretrain_img_size=pretrain_img_size if use_abs_pos else None,
            pretrain_patch_size=patch_size if use_abs_pos else None,
            pretrain_use_cls_token=pretrain_use_cls_token, use_abs_pos=use_abs_pos, rope=None,
            prefix_tokens='drop', out_indices=out_indices, drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate, frozen_stages=frozen_stages, with_cp=with_cp,
            norm_cfg=norm_cfg, act_cfg=act_cfg, pretrained=pretrained, init_cfg=init_cfg)


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
