"""Swin Transformer backbone with detection semantics (Swin-Transformer-Object-Detection / mmdet).

Any input size: the image is padded to the patch size and each block to whole windows (zeros
at the bottom/right), so an ``H x W`` input gives stride-``s`` maps of ``ceil(H / s) x
ceil(W / s)``. The block is :class:`~.swin_block.SwinBlock`; stages, embedding, output norms and
freezing are :class:`~.hierarchical.WindowBackbone`'s. Parameter names are the official ones.
"""
import numbers
from typing import Optional, Sequence, Tuple, Union

from mmcv.cnn import build_norm_layer
from mmdet.registry import MODELS
from mmengine.model.weight_init import trunc_normal_
from torch import nn

from ...functional.sizes import ArgumentError, window_pair
from ...functional.checkpoint_target import CheckpointTarget
from ..layers.arguments import check_flags, check_rates, positive_number, refuse_removed
from ..layers.patch_merging import PatchMerging
from .base import (TRUNC_NORMAL_STD, init_cfg_from_pretrained, init_transformer_weights_,
                   load_init_checkpoint, state_shapes)
from .hierarchical import WindowBackbone
from .swin_archs import SwinArch
from .swin_block import SwinBlock, WindowAttention


@MODELS.register_module()
class SwinBackbone(WindowBackbone):
    """Swin Transformer for detection: multi-scale NCHW maps with a declared contract.

    Args:
        arch: preset (``'tiny'``, ``'small'``, ``'base'``, ``'large'``) or a dict with
            ``embed_dims``, ``depths``, ``num_heads``; those given directly override it.
        in_channels: image channels.
        patch_size: patch embedding stride (the first output stride).
        window_size: attention window, int or ``(wh, ww)``.
        mlp_ratio, qkv_bias, qk_scale: block settings (``qk_scale`` overrides
            ``head_dim ** -0.5``; None or 0: the default).
        drop_rate, attn_drop_rate: dropout after projections / on attention weights.
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks.
        use_abs_pos_embed: add an absolute position embedding stored at the pretraining
            grid (``pretrain_img_size / patch_size``) and bicubically resized to the input.
        pretrain_img_size: image size of that grid (int or ``(h, w)``).
        patch_norm: LayerNorm after the patch embedding and in patch merging.
        stem_channels, stem_norm_cfg: an optional convolutional stem before the patch
            projection (:class:`~..layers.ConvStem`), for training from scratch.
        out_indices: stages whose outputs are returned (each through its own norm).
        frozen_stages: ``-1`` trains everything; ``0`` freezes the patch (and absolute position)
            embedding; ``k >= 1`` also stages ``0..k-1`` and their output norms.
        norm_eval: keep every norm layer in eval mode during training.
        with_cp: activation checkpointing per block (non-reentrant).
        norm_cfg, act_cfg: mmcv config dicts.
        strides, convert_weights: mmdet's arguments, accepted so that mmdet configs build:
            ``strides`` must be ``(patch_size, 2, ...)``; checkpoint formats are detected
            whatever ``convert_weights`` says.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads a Swin checkpoint of any
            layout (docs/checkpoints.md; optional ``prefix``, ``src_window_size=(h, w)``).
        pretrained: deprecated mmdet spelling of ``init_cfg=dict(type='Pretrained',
            checkpoint=...)``.
        removed: refused options (``accel``, ``fused_attn``): the error names what
            replaces each (:data:`~vitdet_plugin.models.layers.arguments.REMOVED_OPTIONS`).
    """

    NO_DECAY_PARAMS = ('absolute_pos_embed', 'relative_position_bias_table')

    def __init__(self,
                 arch: Union[str, dict, None] = 'tiny',
                 embed_dims: Optional[int] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 in_channels: int = 3,
                 patch_size: int = 4,
                 window_size: Union[int, Tuple[int, int]] = 7,
                 mlp_ratio: float = 4.0,
                 qkv_bias: bool = True,
                 qk_scale: Optional[float] = None,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1,
                 use_abs_pos_embed: bool = False,
                 pretrain_img_size: Union[int, Tuple[int, int]] = 224,
                 patch_norm: bool = True,
                 stem_channels: Sequence[int] = (),
                 stem_norm_cfg: Optional[dict] = None,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 strides: Optional[Sequence[int]] = None,
                 convert_weights: bool = True,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None,
                 **removed: object) -> None:
        refuse_removed(type(self).__name__, removed)
        init_cfg = init_cfg_from_pretrained(pretrained, init_cfg)
        spec = SwinArch.resolve(arch, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        window = window_pair(window_size, 'window_size')
        expected_strides = (patch_size,) + (2,) * (len(spec.depths) - 1)
        if strides is not None and tuple(strides) != expected_strides:
            raise ArgumentError(f'strides={tuple(strides)} is not supported: Swin uses the '
                                f'patch size then 2x patch merging, i.e. {expected_strides}')
        if qk_scale is not None and (not isinstance(qk_scale, numbers.Real) or qk_scale < 0):
            raise ValueError(f'qk_scale must be None or a non-negative number (0: the default '
                             f'head_dim ** -0.5), got {qk_scale!r}')
        positive_number(mlp_ratio, 'mlp_ratio')
        check_rates(attn_drop_rate=attn_drop_rate)
        check_flags(qkv_bias=qkv_bias, convert_weights=convert_weights)
        norm_cfg = norm_cfg or dict(type='LN')

        def block(stage: int, index: int, dim: int, heads: int, drop_path: float) -> nn.Module:
            """W-MSA and SW-MSA blocks in turn."""
            return SwinBlock(dim, heads, window, shift=index % 2 == 1, mlp_ratio=mlp_ratio,
                             qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop_rate,
                             attn_drop=attn_drop_rate, drop_path=drop_path, norm_cfg=norm_cfg,
                             act_cfg=act_cfg)

        def merge(dim: int) -> nn.Module:
            """Concat 2x2 -> norm (with ``patch_norm``) -> linear ``4C -> 2C``."""
            norm = build_norm_layer(norm_cfg, 4 * dim)[1] if patch_norm else nn.Identity()
            return PatchMerging(dim, norm)

        super().__init__(
            spec, block, merge, in_channels=in_channels, patch_size=patch_size,
            out_indices=out_indices, frozen_stages=frozen_stages, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, patch_norm=patch_norm, norm_eval=norm_eval,
            with_cp=with_cp, norm_cfg=norm_cfg, stem_channels=stem_channels,
            stem_norm_cfg=stem_norm_cfg, use_abs_pos_embed=use_abs_pos_embed,
            pretrain_img_size=pretrain_img_size, init_cfg=init_cfg)
        self.window_size = window
        self.convert_weights = convert_weights

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a Swin checkpoint for."""
        pos = self.absolute_pos_embed.shape[-2:] if self.use_abs_pos_embed else None
        return CheckpointTarget('Swin', type(self).__name__, state_shapes(self),
                                window_size=self.window_size, out_indices=self.out_indices,
                                pos_grid=(pos[0], pos[1]) if pos is not None else None,
                                arch_presets=SwinArch.PRESETS)

    def init_weights(self) -> None:
        """Truncated-normal init, or load ``init_cfg.checkpoint`` through the layout table."""
        if load_init_checkpoint(self, 'src_window_size'):
            return
        if self.use_abs_pos_embed:
            trunc_normal_(self.absolute_pos_embed, std=TRUNC_NORMAL_STD)
        init_transformer_weights_(self)
        for m in self.modules():
            if isinstance(m, WindowAttention):
                trunc_normal_(m.relative_position_bias_table, std=TRUNC_NORMAL_STD)
        self._is_init = True
