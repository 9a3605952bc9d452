"""Plain ViT backbone for detection (ViTDet; SAM's image encoder).

Li et al., *Exploring Plain Vision Transformer Backbones for Object Detection* (2022): a
non-hierarchical ViT with a 16x16 patch embedding, an absolute position embedding stored at the
pretraining grid and bicubically resized to the input, blocks with window attention (14x14)
except a few global-attention blocks, decomposed relative positions (MViTv2) and optional
residual conv blocks; it outputs one stride-16 map. Numerically it equals detectron2's
``ViT``, SAM's ``ImageEncoderViT`` trunk and timm's ``VisionTransformerSAM`` blocks.

Parameter names follow timm / SAM / detectron2 (``patch_embed.proj``, ``pos_embed``,
``blocks.{i}.{norm1, attn.qkv, attn.proj, attn.rel_pos_h, attn.rel_pos_w, norm2, mlp.fc1,
mlp.fc2, residual.*}``); :mod:`vitdet_plugin.weights.vit` converts the checkpoint layouts.
"""
import numbers
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as cp
from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...weights.common import resize_pos_grid
from ...weights.vit import load_vit_pretrained
from ..layers import (Attention, DropPath, Mlp, PatchEmbed, ResBottleneckBlock, TensorWatch,
                      WindowIndex, attend, builds_cache, decomposed_rel_pos_bias,
                      decomposed_rel_pos_terms, int_arg, int_tuple, linear_drop_path_rates,
                      positive_int, rel_pos_attention, residual_add, to_2tuple,
                      window_gather_index)
from ..necks.simple_fpn import ViTSimpleFPN
from .base import FreezeMixin, pretrained_init_cfg

#: ``arch`` presets: the ViTDet models (detectron2 ``projects/ViTDet``).
VIT_ARCHS: Dict[str, dict] = {
    'base': dict(embed_dims=768, depth=12, num_heads=12, global_attn_indexes=(2, 5, 8, 11),
                 drop_path_rate=0.1),
    'large': dict(embed_dims=1024, depth=24, num_heads=16,
                  global_attn_indexes=(5, 11, 17, 23), drop_path_rate=0.4),
    'huge': dict(embed_dims=1280, depth=32, num_heads=16,
                 global_attn_indexes=(7, 15, 23, 31), drop_path_rate=0.5),
}
#: Number of evenly spaced global-attention blocks for custom ``arch`` dicts (as the presets).
NUM_GLOBAL_BLOCKS = 4
#: Input grid sizes whose window gather indices are kept (multi-scale training sees many).
WINDOW_INDEX_CACHE_SIZE = 16


class ViTAttention(Attention):
    """Multi-head attention over a ``(B, H, W, C)`` grid with decomposed relative positions.

    The relative-position bias (per-axis tables ``rel_pos_h`` / ``rel_pos_w`` of
    ``2 * size - 1`` rows, linearly resized when the grid differs) is passed to the shared
    attention core as the additive ``attn_mask`` of ``F.scaled_dot_product_attention``.

    In training (grad enabled, fused, no attention dropout) the attention goes through
    :func:`rel_pos_attention`, whose backward recomputes the probabilities instead of keeping
    the ``(heads, N, N)`` matrices of PyTorch's math fallback.

    With ``window_size`` the grid is zero-padded at the bottom/right to whole windows and
    attention runs per window (detectron2 / SAM semantics). A padded token's q/k/v is the qkv
    bias, so the projections run on the real tokens only; one gather builds the padded windows
    from the ``qkv`` output and one gather takes the real tokens back before ``proj``: the
    reference result with fewer FLOPs and copies than padding, partitioning and cropping.

    Args:
        rel_pos_size: ``(h, w)`` grid the tables are sized for; ``None`` disables them.
        window_size: ``(wh, ww)`` of window attention; ``None`` for global attention.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True,
                 rel_pos_size: Optional[Tuple[int, int]] = None,
                 window_size: Optional[Tuple[int, int]] = None) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, fused)
        self.window_size = window_size
        self.use_rel_pos = rel_pos_size is not None
        if self.use_rel_pos:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_pos_size[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_pos_size[1] - 1, self.head_dim))

    def forward(self, x: Tensor,  # type: ignore[override]
                index: Optional[WindowIndex] = None) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``: global attention over all ``H * W`` tokens, or
        window attention with the gather ``index`` of :func:`window_gather_index`."""
        b, h, w, c = x.shape
        qkv = self.qkv(x.reshape(b, h * w, c))                   # (B, HW, 3C)
        if index is None:
            wh, ww = h, w
        else:
            wh, ww = self.window_size
            qkv = qkv.index_select(1, index.fwd)                 # (B, nW * N, 3C), one copy
            if index.pad.numel():  # padded tokens: qkv of a zero token = the qkv bias
                qkv[:, index.pad] = (self.qkv.bias.to(qkv.dtype) if self.qkv.bias is not None
                                     else 0.0)  # autocast: qkv may be fp16 / bf16
        n = wh * ww
        qkv = qkv.view(-1, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                       # (B * nW, heads, N, d)
        dropout = self.attn_drop if self.training else 0.0
        if self.use_rel_pos and self.fused and dropout == 0.0 and torch.is_grad_enabled():
            # training: don't keep (heads, N, N) probabilities / bias for backward
            rel_h, rel_w = decomposed_rel_pos_terms(q, self.rel_pos_h, self.rel_pos_w,
                                                    (wh, ww), (wh, ww))
            out = rel_pos_attention(q, k, v, rel_h, rel_w)
        else:
            bias = (decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (wh, ww),
                                            (wh, ww)) if self.use_rel_pos else None)
            out = attend(q, k, v, bias, dropout, self.fused)
        out = out.transpose(1, 2).reshape(b, -1, c)             # (B, nW * N | HW, C)
        if index is not None:
            out = index.reverse(out, b)                          # (B, HW, C), crop included
        return self.proj_drop(self.proj(out)).view(b, h, w, c)


class ViTBlock(nn.Module):
    """Pre-norm transformer block on ``(B, H, W, C)`` with window or global attention.

    Window blocks attend within zero-padded windows and crop back (see :class:`ViTAttention`).

    Args:
        window_size: ``(wh, ww)`` for window attention, ``None`` for global attention.
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
        act_cfg = act_cfg or dict(type='GELU')
        act_layer = partial(build_activation_layer, act_cfg)
        self.window_size = window_size
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.attn = ViTAttention(dim, num_heads, qkv_bias, attn_drop, drop, fused_attn,
                                 rel_pos_size, window_size)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        self.residual = ResBottleneckBlock(dim, dim // 2, act_layer) if residual else None

    def forward(self, x: Tensor, index: Optional[WindowIndex] = None) -> Tensor:
        """``x``: ``(B, H, W, C)``; ``index``: the window gather index of the ``(H, W)`` grid
        (window blocks only, see :meth:`ViTBackbone.window_index`)."""
        if self.window_size is None:
            index = None
        elif index is None:
            index = window_gather_index(tuple(x.shape[1:3]), self.window_size, device=x.device)
        x = residual_add(x, self.drop_path(self.attn(self.norm1(x), index)))
        x = residual_add(x, self.drop_path(self.mlp(self.norm2(x))))
        if self.residual is not None:
            x = self.residual(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return x

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}'


def _index_list(name: str, values: Sequence[int], depth: int,
                negative: bool = False) -> Tuple[int, ...]:
    """Sorted unique block indices; with ``negative``, ``-1`` is the last block."""
    values = int_tuple(values, name)
    low = -depth if negative else 0
    bad = [v for v in values if not low <= v < depth]
    if bad:
        raise ValueError(f'{name}={values} contains {bad}, out of range for depth={depth}: '
                         f'block indices must be in {low}..{depth - 1}')
    return tuple(sorted({v % depth for v in values}))


def _resolve_arch(arch: Union[str, dict, None], **overrides) -> dict:
    """Merge a preset (or custom dict) with the arguments given explicitly."""
    if isinstance(arch, str):
        if arch not in VIT_ARCHS:
            raise ValueError(f'arch={arch!r} is not a ViT preset; choose one of '
                             f'{sorted(VIT_ARCHS)} or pass a dict with embed_dims, depth and '
                             'num_heads')
        spec = dict(VIT_ARCHS[arch])
    elif isinstance(arch, dict):
        unknown = set(arch) - {'embed_dims', 'depth', 'num_heads', 'global_attn_indexes',
                               'drop_path_rate'}
        if unknown:
            raise ValueError(f'arch dict has unknown keys {sorted(unknown)}; accepted: '
                             'embed_dims, depth, num_heads, global_attn_indexes, drop_path_rate')
        spec = dict(arch)
    elif arch is None:
        spec = {}
    else:
        raise TypeError(f'arch must be a preset name, a dict or None, got {type(arch).__name__}')
    spec.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in ('embed_dims', 'depth', 'num_heads') if k not in spec]
    if missing:
        raise ValueError(f'ViT architecture is missing {missing}; give a preset arch '
                         f'({sorted(VIT_ARCHS)}) or embed_dims, depth and num_heads')
    depth = int_arg(spec['depth'], 'depth')
    if depth <= 0:
        raise ValueError(f'depth must be positive, got {depth}')
    if 'global_attn_indexes' not in spec:  # the presets' rule: the last block of each quarter
        n = min(NUM_GLOBAL_BLOCKS, depth)
        spec['global_attn_indexes'] = tuple((k + 1) * depth // n - 1 for k in range(n))
    spec.setdefault('drop_path_rate', 0.0)
    return spec


@MODELS.register_module()
class ViTBackbone(FreezeMixin, BaseModule):
    """Plain ViT (ViTDet) with window attention, global blocks and decomposed rel-pos.

    Args:
        arch: preset ``'base'`` / ``'large'`` / ``'huge'`` (ViTDet: embed 768/1024/1280, depth
            12/24/32, heads 12/16/16, global blocks [2,5,8,11]/[5,11,17,23]/[7,15,23,31],
            drop path 0.1/0.4/0.5) or a dict with ``embed_dims``, ``depth``, ``num_heads``
            (and optionally ``global_attn_indexes``, ``drop_path_rate``). Arguments given
            directly override it. Custom archs default to global attention in the last block
            of each quarter and no drop path.
        global_attn_indexes: blocks with global attention; all others use window attention.
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
            embeddings; ``k >= 1`` also the first ``k`` blocks (``requires_grad=False``,
            kept in eval mode).
        with_cp: activation checkpointing per block (``torch.utils.checkpoint``,
            non-reentrant).
        fused_attn: attention through ``F.scaled_dot_product_attention`` (False: eager).
        pyramid: build a :class:`ViTSimpleFPN` inside the backbone (e.g.
            ``dict(out_channels=256)``; ``True`` for the defaults) so it outputs strides
            4/8/16/32 like a hierarchical backbone; ``num_outs`` defaults to the number of
            scale factors.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads timm ViT / DeiT / MAE,
            SAM, timm ``samvit``, detectron2 ViTDet or our own checkpoints (format detected,
            ``weights_only=True``, strict with a report).

    Attributes:
        out_channels: channels of each returned map.
        out_strides: stride of each returned map.
    """

    def __init__(self,
                 arch: Union[str, dict, None] = 'base',
                 embed_dims: Optional[int] = None,
                 depth: Optional[int] = None,
                 num_heads: Optional[int] = None,
                 global_attn_indexes: Optional[Sequence[int]] = None,
                 drop_path_rate: Optional[float] = None,
                 in_channels: int = 3,
                 patch_size: int = 16,
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
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pyramid: Union[None, bool, dict] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError('give either pretrained or init_cfg, not both')
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)
        spec = _resolve_arch(arch, embed_dims=embed_dims, depth=depth, num_heads=num_heads,
                             global_attn_indexes=global_attn_indexes,
                             drop_path_rate=drop_path_rate)
        self.embed_dims = int_arg(spec['embed_dims'], 'embed_dims')
        self.depth = int_arg(spec['depth'], 'depth')
        self.num_heads = int_arg(spec['num_heads'], 'num_heads')
        if self.num_heads <= 0 or self.embed_dims % self.num_heads:
            raise ValueError(f'embed_dims={self.embed_dims} is not divisible by num_heads='
                             f'{self.num_heads}; choose a head count that divides it')
        self.global_attn_indexes = _index_list('global_attn_indexes',
                                               spec['global_attn_indexes'], self.depth)
        self.residual_block_indexes = _index_list('residual_block_indexes',
                                                  residual_block_indexes, self.depth)
        self.window_size = to_2tuple(window_size, 'window_size')
        if min(self.window_size) <= 0:
            raise ValueError(f'window_size must be positive, got {window_size!r}; for global '
                             'attention in every block list all blocks in global_attn_indexes')
        positive_int(patch_size, 'patch_size')
        if int_arg(in_channels, 'in_channels') <= 0:
            raise ValueError(f'in_channels must be positive, got {in_channels}')
        rate = spec['drop_path_rate']
        if not (isinstance(rate, numbers.Real) and not isinstance(rate, bool)
                and 0.0 <= rate < 1.0):
            raise ValueError(f'drop_path_rate must be a number in [0, 1), got {rate!r}')
        out_indices = int_tuple(out_indices, 'out_indices')
        if not out_indices:
            raise ValueError('out_indices is empty; give at least one block index (-1: the '
                             'last block)')
        self.out_indices = _index_list('out_indices', out_indices, self.depth, negative=True)
        if not -1 <= int_arg(frozen_stages, 'frozen_stages') <= self.depth:
            raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{self.depth} '
                             '(-1: train all, 0: patch/position embeddings, k: also the first '
                             'k blocks)')
        self.frozen_stages = frozen_stages
        self.with_cp = with_cp
        self.patch_size = patch_size
        self.in_channels = in_channels
        norm_cfg = norm_cfg or dict(type='LN', eps=1e-6)
        act_cfg = act_cfg or dict(type='GELU')

        for name, size in (('img_size', img_size), ('pretrain_img_size', pretrain_img_size)):
            if min(to_2tuple(size, name)) < patch_size:
                raise ValueError(f'{name}={size!r} is smaller than patch_size={patch_size}: '
                                 f'the grid it describes would be empty; give the image size '
                                 f'(at least one patch per side)')
        self.patch_embed = PatchEmbed(patch_size, in_channels, self.embed_dims)
        self.pretrain_grid = tuple(s // patch_size for s in to_2tuple(pretrain_img_size))
        self.num_pos_prefix = int(bool(pretrain_use_cls_token))
        if use_abs_pos:
            n = self.pretrain_grid[0] * self.pretrain_grid[1] + self.num_pos_prefix
            self.pos_embed = nn.Parameter(torch.zeros(1, n, self.embed_dims))
        else:
            self.register_parameter('pos_embed', None)
        self._pos_cache: Optional[Tuple[tuple, Tensor]] = None   # (grid size, embedding)
        self._pos_watch = TensorWatch()
        self._window_index_cache: Dict[tuple, WindowIndex] = {}

        full_grid = tuple(s // patch_size for s in to_2tuple(img_size))
        rates = linear_drop_path_rates(float(spec['drop_path_rate']), self.depth)
        self.blocks = nn.ModuleList()
        for i in range(self.depth):
            is_global = i in self.global_attn_indexes
            rel_size = (full_grid if is_global else self.window_size) if use_rel_pos else None
            self.blocks.append(ViTBlock(
                self.embed_dims, self.num_heads, None if is_global else self.window_size,
                rel_size, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], norm_cfg,
                act_cfg, i in self.residual_block_indexes, fused_attn))

        self.pyramid: Optional[ViTSimpleFPN] = None
        if pyramid:
            if len(self.out_indices) != 1:
                raise ValueError(f'pyramid needs a single backbone output, got out_indices='
                                 f'{self.out_indices}')
            cfg = dict(pyramid) if isinstance(pyramid, dict) else {}
            cfg.pop('type', None)
            derived = sorted({'in_channels', 'in_stride'} & set(cfg))
            if derived:
                raise ValueError(f'pyramid={pyramid!r} sets {derived}, which the backbone '
                                 f'gives it (embed_dims={self.embed_dims}, patch_size='
                                 f'{patch_size}); leave them out of the pyramid dict')
            cfg.setdefault('num_outs', len(cfg.get('scale_factors', (4.0, 2.0, 1.0, 0.5))))
            self.pyramid = ViTSimpleFPN(in_channels=self.embed_dims, in_stride=patch_size,
                                        **cfg)
            self.out_channels: Tuple[int, ...] = self.pyramid.out_channels
            self.out_strides: Tuple[int, ...] = self.pyramid.out_strides
        else:
            self.out_channels = (self.embed_dims,) * len(self.out_indices)
            self.out_strides = (patch_size,) * len(self.out_indices)
        self._init_vit_weights()
        self._freeze_stages()

    # ------------------------------------------------------------------ weights
    def _init_vit_weights(self) -> None:
        """detectron2's ViT init: trunc-normal(0.02) position embedding and linears."""
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=0.02)
        for m in self.blocks.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.blocks.modules():  # MSRA convs, zero last norm: identity at init
            if isinstance(m, ResBottleneckBlock):
                m.reset_parameters()

    def init_weights(self) -> None:
        """Load ``init_cfg.checkpoint`` (any supported layout) or keep the constructor init."""
        pretrained = pretrained_init_cfg(self.init_cfg)
        if pretrained is not None:
            load_vit_pretrained(self, pretrained['checkpoint'], prefix=pretrained.get('prefix'))
            self._is_init = True
            return
        super().init_weights()

    # ------------------------------------------------------------------ freezing / modes
    def frozen_modules(self) -> List[nn.Module]:
        mods: List[nn.Module] = [self.patch_embed] if self.frozen_stages >= 0 else []
        return mods + list(self.blocks[:max(self.frozen_stages, 0)])

    def frozen_parameters(self) -> List[nn.Parameter]:
        return [self.pos_embed] if self.frozen_stages >= 0 and self.pos_embed is not None \
            else []

    # ------------------------------------------------------------------ forward
    @builds_cache
    def window_index(self, hw: Tuple[int, int], device: torch.device) -> WindowIndex:
        """Gather indices that pad and partition an ``hw`` token grid into windows (and
        back), cached per grid size and device."""
        key = (tuple(hw), str(device))
        index = self._window_index_cache.get(key)
        if index is None:
            if len(self._window_index_cache) >= WINDOW_INDEX_CACHE_SIZE:
                self._window_index_cache.clear()
            index = window_gather_index(tuple(hw), self.window_size, device=device)
            self._window_index_cache[key] = index
        return index

    def abs_pos_embed(self, hw: Tuple[int, int]) -> Tensor:
        """The position embedding for an ``hw`` token grid, ``(1, h, w, C)`` (bicubic resize
        of the stored grid; cached while the parameter is unchanged and no grad is needed)."""
        pos = self.pos_embed
        cacheable = not (torch.is_grad_enabled() and pos.requires_grad)
        if cacheable:
            if self._pos_watch.changed(pos):
                self._pos_cache = None
            elif self._pos_cache is not None and self._pos_cache[0] == hw:
                return self._pos_cache[1]
        gh, gw = self.pretrain_grid
        grid = pos[:, self.num_pos_prefix:].reshape(1, gh, gw, -1)
        if (gh, gw) != tuple(hw):
            grid = resize_pos_grid(grid.permute(0, 3, 1, 2), hw).permute(0, 2, 3, 1)
        self._pos_cache = (hw, grid.detach()) if cacheable else None
        return grid

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> ``(B, C, ceil(H / 16), ceil(W / 16))`` per output index, or
        the pyramid levels ``(B, C_out, ...)`` at :attr:`out_strides`."""
        x = self.patch_embed(x)                                     # (B, h, w, C)
        if self.pos_embed is not None:
            x = x + self.abs_pos_embed(tuple(x.shape[1:3]))
        index = self.window_index(tuple(x.shape[1:3]), x.device)
        outs = []
        use_cp = self.with_cp and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if use_cp and i >= self.frozen_stages:
                x = cp.checkpoint(block, x, index, use_reentrant=False)
            else:
                x = block(x, index)
            if i in self.out_indices:
                outs.append(x.permute(0, 3, 1, 2).contiguous())
        if self.pyramid is not None:
            return self.pyramid(outs[-1])
        return tuple(outs)
