"""Swin Transformer backbone with detection semantics (Swin-Transformer-Object-Detection / mmdet).

Patch partition + linear embedding, stages of alternating W-MSA / SW-MSA blocks with a
relative-position bias and the shifted-window mask, patch merging between stages, and a
LayerNorm per output. Any input size works: the image is padded to the patch size and each
block pads its input to the window size (zeros at the bottom/right), so an ``H x W`` input gives
stride-``s`` maps of ``ceil(H / s) x ceil(W / s)``.

Parameter names follow the official Microsoft layout (``layers.{i}.blocks.{j}...``, downsample
at the end of stage ``i``), so official checkpoints load without renaming; other layouts are
converted by :mod:`vitdet_plugin.weights.swin`.
"""
from functools import partial
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...weights.swin import load_swin_pretrained
from .base import FreezeMixin, pretrained_init_cfg
from ..layers import (ConvStem, DropPath, Mlp, PatchEmbed, PatchMerging, WindowAttention,
                      WindowIndex, WindowPlan, builds_cache, chunk_slices, inference_fast_path,
                      int_tuple, linear_drop_path_rates, map_height_chunks, padded_size,
                      positive_int, residual_add, rows_per_chunk, shifted_window_mask,
                      to_2tuple, window_gather_index, window_plan)

#: ``arch`` presets: embed dims, depths and heads of the published Swin models.
SWIN_ARCHS: Dict[str, dict] = {
    'tiny': dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    'small': dict(embed_dims=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    'base': dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    'large': dict(embed_dims=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
}


class SwinBlock(nn.Module):
    """One Swin block on ``(B, H, W, C)``: (shifted) window attention, then an MLP.

    Args:
        dim: channels.
        num_heads: attention heads.
        window_size: ``(wh, ww)``.
        shift: shift the windows by half a window (SW-MSA) instead of W-MSA.
        mlp_ratio: MLP hidden width / ``dim``.
        drop_path: stochastic-depth rate of this block.
        norm_cfg, act_cfg: mmcv config dicts for the norms and the MLP activation.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int], shift: bool,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None, fused_attn: bool = True) -> None:
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN')
        act_cfg = act_cfg or dict(type='GELU')
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.attn = WindowAttention(dim, num_heads, window_size, qkv_bias, qk_scale, attn_drop,
                                    drop, fused_attn)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=partial(build_activation_layer,
                                                                    act_cfg), drop=drop)

    @property
    def shifted(self) -> bool:
        return any(self.shift_size)

    def forward(self, x: Tensor, geometry: 'WindowGeometry') -> Tensor:
        """``x``: ``(B, H, W, C)``; ``geometry``: the stage's cached windowing of ``(H, W)``."""
        b, h, w, c = x.shape
        index = geometry.shifted_index if self.shifted else geometry.index
        windows = index.partition(self.norm1(x).view(b, h * w, c), geometry.window_tokens)
        windows = self.attn(windows, geometry.shift_mask if self.shifted else None)
        x = residual_add(x, self.drop_path(index.reverse(windows, b).view(b, h, w, c)))
        return residual_add(x, self.drop_path(self.mlp(self.norm2(x))))

    @torch.no_grad()
    def forward_inplace_(self, tokens: Tensor, plan: WindowPlan,
                         shift_mask: Optional[Tensor]) -> None:
        """Inference (eval mode): apply the block to a flat token buffer in place.

        ``tokens``: ``(B * H * W, C)``, the images' tokens one after another; ``plan``: this
        block's (shifted) windows; ``shift_mask``: ``(M, N, N)``, the masks of the plan's
        masked windows (from ``plan.first_masked`` on) in plan order, or None.
        Same values as :meth:`forward`, without its full-size temporaries: each chunk of
        windows is gathered, normalised, attended and scatter-added back into its rows (the
        residual), then the MLP runs over row chunks and is added in place.
        """
        shared = self.attn.window_bias(None)
        masked = None if shift_mask is None else self.attn.window_bias(shift_mask)
        first_masked = plan.first_masked
        for chunk in plan.chunks:
            start, stop = chunk.windows.start, chunk.windows.stop
            bias = (shared if start < first_masked
                    else masked[start - first_masked:stop - first_masked])
            x = self.norm1(tokens.index_select(0, chunk.rows))
            out = self.attn.forward_tokens(x, chunk.real, stop - start, bias)
            tokens.index_add_(0, chunk.rows, out)
        step = rows_per_chunk(self.mlp.fc1.out_features, tokens.element_size())
        for part in chunk_slices(tokens.shape[0], step):
            x = tokens[part]
            self.mlp.add_to_(x, self.norm2(x))


class WindowGeometry(NamedTuple):
    """How a stage splits an ``(H, W)`` map into (shifted) windows; built once per size.

    ``index`` / ``shifted_index``: gather indices (see :func:`window_gather_index`) that pad,
    shift and partition in one copy, and undo it.
    """
    index: WindowIndex
    shifted_index: Optional[WindowIndex]
    shift_mask: Optional[Tensor]
    window_tokens: int


class InferencePlans(NamedTuple):
    """A stage's windows for the in-place inference path (see :func:`window_plan`), and the
    shift masks ``(M, N, N)`` of the shifted plan's masked windows, in plan order (None:
    no window wraps around)."""
    plain: WindowPlan
    shifted: Optional[WindowPlan]
    shift_mask: Optional[Tensor]


class SwinStage(nn.Module):
    """``depth`` blocks alternating W-MSA / SW-MSA, then optional patch merging.

    The windowing (gather indices, shift mask) depends only on the feature size; it is built
    once per size and device and reused by every block and every call.
    """

    def __init__(self, dim: int, depth: int, num_heads: int, window_size: Tuple[int, int],
                 drop_paths: Sequence[float], downsample: bool, norm_cfg: dict,
                 with_cp: bool = False, merge_norm: bool = True, **block_kwargs) -> None:
        super().__init__()
        self.window_size = window_size
        self.with_cp = with_cp
        self.blocks = nn.ModuleList([
            SwinBlock(dim, num_heads, window_size, shift=(j % 2 == 1), drop_path=drop_paths[j],
                      norm_cfg=norm_cfg, **block_kwargs) for j in range(depth)
        ])
        self.downsample = (PatchMerging(dim, build_norm_layer(norm_cfg, 4 * dim)[1]
                                        if merge_norm else nn.Identity())
                           if downsample else None)
        self._geometry_cache: Dict[tuple, WindowGeometry] = {}
        self._plan_cache: Dict[tuple, InferencePlans] = {}

    @builds_cache
    def geometry(self, hw: Tuple[int, int], device: torch.device) -> WindowGeometry:
        """Cached windowing (gather indices, shift mask) of an ``(H, W)`` map."""
        key = (tuple(hw), device)
        geom = self._geometry_cache.get(key)
        if geom is None:
            hp, wp = padded_size(hw, self.window_size)
            shift = next((blk.shift_size for blk in self.blocks if blk.shifted), None)
            geom = WindowGeometry(
                index=window_gather_index(hw, self.window_size, device=device),
                shifted_index=(window_gather_index(hw, self.window_size, shift, device)
                               if shift else None),
                shift_mask=(shifted_window_mask((hp, wp), self.window_size, shift, device)
                            if shift else None),
                window_tokens=self.window_size[0] * self.window_size[1])
            self._geometry_cache.clear()  # keep only the latest size
            self._geometry_cache[key] = geom
        return geom

    @builds_cache
    def window_plans(self, hw: Tuple[int, int], batch: int, device: torch.device,
                     windows_per_chunk: int) -> InferencePlans:
        """Inference walk over the (plain, shifted) windows of ``batch`` images of size
        ``hw`` in a flat token buffer; cached per size, batch, device and chunk size."""
        key = (tuple(hw), batch, device, windows_per_chunk)
        cached = self._plan_cache.get(key)
        if cached is None:
            geom = self.geometry(hw, device)
            plain = window_plan(geom.index, batch, geom.window_tokens, windows_per_chunk)
            shifted = mask = None
            if geom.shifted_index is not None:
                num_windows = geom.shift_mask.shape[0]
                needs_mask = geom.shift_mask.view(num_windows, -1).ne(0).any(1)
                shifted = window_plan(geom.shifted_index, batch, geom.window_tokens,
                                      windows_per_chunk, masked=needs_mask)
                if shifted.first_masked < shifted.order.numel():
                    mask = geom.shift_mask[shifted.order[shifted.first_masked:]]
            cached = InferencePlans(plain, shifted, mask)
            self._plan_cache.clear()
            self._plan_cache[key] = cached
        return cached

    def forward_inplace_(self, x: Tensor) -> Tensor:
        """Inference (eval, no autograd) on ``x`` ``(B, H, W, C)``, which is overwritten with
        the stage's block output (when contiguous; else a copy is made) and returned."""
        b, h, w, c = x.shape
        x = x.contiguous()
        tokens = x.view(-1, c)
        step = self.blocks[0].attn.windows_per_chunk(x.element_size())
        plans = self.window_plans((h, w), b, x.device, step)
        for blk in self.blocks:
            if blk.shifted:
                blk.forward_inplace_(tokens, plans.shifted, plans.shift_mask)
            else:
                blk.forward_inplace_(tokens, plans.plain, None)
        return x

    def forward(self, x: Tensor, consume_input: bool = False) -> Tuple[Tensor, Tensor]:
        """``(B, H, W, C)`` -> (stage output ``(B, H, W, C)``, input of the next stage).

        ``consume_input``: at inference (eval, no autograd, no autocast), ``x``'s storage may
        serve as the token buffer (the backbone passes tensors it made itself); otherwise
        ``x`` is left untouched.
        """
        if not self.training and inference_fast_path(x):
            x = self.forward_inplace_(x if consume_input
                                      else x.clone(memory_format=torch.contiguous_format))
            return x, (self.downsample(x) if self.downsample is not None else x)
        geom = self.geometry(x.shape[1:3], x.device)
        for blk in self.blocks:
            if self.with_cp and self.training and torch.is_grad_enabled():
                x = cp.checkpoint(blk, x, geom, use_reentrant=False)
            else:
                x = blk(x, geom)
        return x, (self.downsample(x) if self.downsample is not None else x)


def _resolve_arch(arch: Union[str, dict, None], **overrides) -> dict:
    if isinstance(arch, str):
        if arch not in SWIN_ARCHS:
            raise ValueError(f'unknown Swin arch {arch!r}; choose one of '
                             f'{sorted(SWIN_ARCHS)} or pass a dict with embed_dims, depths '
                             f'and num_heads')
        spec = dict(SWIN_ARCHS[arch])
    elif isinstance(arch, dict):
        spec = dict(arch)
    elif arch is None:
        spec = {}
    else:
        raise TypeError(f'arch must be a preset name or a dict, got {type(arch).__name__}')
    spec.update({k: v for k, v in overrides.items() if v is not None})
    missing = {'embed_dims', 'depths', 'num_heads'} - set(spec)
    if missing:
        raise ValueError(f'Swin arch is missing {sorted(missing)}: give a preset name '
                         f'({sorted(SWIN_ARCHS)}) or all of embed_dims, depths, num_heads')
    depths, heads = tuple(spec['depths']), tuple(spec['num_heads'])
    if len(depths) != len(heads) or not depths:
        raise ValueError(f'depths {depths} and num_heads {heads} must be non-empty and of '
                         'equal length (one entry per stage)')
    if any(d <= 0 for d in depths):
        raise ValueError(f'every stage needs at least one block, got depths={depths}')
    return dict(embed_dims=int(spec['embed_dims']), depths=depths, num_heads=heads)


@MODELS.register_module()
class SwinBackbone(FreezeMixin, BaseModule):
    """Swin Transformer for detection: multi-scale NCHW maps with a declared contract.

    Args:
        arch: preset (``'tiny'``, ``'small'``, ``'base'``, ``'large'``) or a dict with
            ``embed_dims``, ``depths``, ``num_heads``; ``embed_dims`` / ``depths`` /
            ``num_heads`` given directly override it.
        in_channels: image channels.
        patch_size: patch embedding stride (the first output stride).
        window_size: attention window, int or ``(wh, ww)``.
        mlp_ratio, qkv_bias, qk_scale: block settings (``qk_scale`` overrides
            ``head_dim ** -0.5``).
        drop_rate, attn_drop_rate: dropout after projections / on attention weights.
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks.
        use_abs_pos_embed: add an absolute position embedding stored at the pretraining
            grid (``pretrain_img_size / patch_size``) and bicubically resized to the input.
        pretrain_img_size: image size of that grid (int or ``(h, w)``).
        patch_norm: LayerNorm after the patch embedding and in patch merging (as mmdet's
            ``patch_norm``).
        stem_channels: optional convolutional stem (:class:`~..layers.ConvStem`): one ``3x3``
            stride-2 conv + norm + ReLU per entry, before a patch projection covering the rest
            of ``patch_size``. Not part of the published Swin (no official weights): for
            training from scratch, where it speeds up convergence. Empty: the standard
            ``patch_size x patch_size`` linear embedding.
        stem_norm_cfg: norm config of the stem's convolutions (default BN).
        out_indices: stages whose outputs are returned (each through its own norm).
        frozen_stages: ``-1`` trains everything; ``0`` freezes the patch embedding (and the
            absolute position embedding); ``k >= 1`` also freezes stages ``0..k-1`` and their
            output norms. Frozen parameters get ``requires_grad=False`` and stay in eval mode.
        norm_eval: keep every norm layer in eval mode during training (matters for BN/GN
            norm configs).
        with_cp: activation checkpointing per block (non-reentrant) to save memory.
        fused_attn: attention through ``F.scaled_dot_product_attention`` (False: eager).
        norm_cfg, act_cfg: mmcv config dicts.
        strides: accepted for mmdet-config compatibility; must equal
            ``(patch_size, 2, 2, ...)``.
        convert_weights: accepted for mmdet-config compatibility; checkpoint formats are
            detected automatically.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads official, Swin detection,
            timm, mmdet/mmpretrain or our own checkpoints (format detected, weights_only; a
            path, ``~`` path or http(s) URL; optional ``prefix`` and, for a checkpoint with a
            rectangular window, ``src_window_size=(h, w)``).

    Attributes:
        out_channels: channels of each returned map.
        out_strides: stride of each returned map.
    """

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
                 fused_attn: bool = True,
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 strides: Optional[Sequence[int]] = None,
                 convert_weights: bool = True,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError('give either pretrained or init_cfg, not both')
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)
        spec = _resolve_arch(arch, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        self.embed_dims, self.depths, self.num_heads = (spec['embed_dims'], spec['depths'],
                                                        spec['num_heads'])
        num_stages = len(self.depths)
        dims = [self.embed_dims * 2**i for i in range(num_stages)]
        for i, (dim, heads) in enumerate(zip(dims, self.num_heads)):
            if heads <= 0 or dim % heads:
                raise ValueError(f'stage {i}: embed dims {dim} are not divisible by '
                                 f'num_heads={heads}; choose heads that divide '
                                 f'embed_dims * 2**stage')
        if in_channels <= 0:
            raise ValueError(f'in_channels must be positive, got {in_channels}')
        positive_int(patch_size, 'patch_size', ' (the first output stride)')
        self.window_size = to_2tuple(window_size, 'window_size')
        if min(self.window_size) <= 0:
            raise ValueError(f'window_size must be positive, got {window_size!r}')
        expected_strides = (patch_size,) + (2,) * (num_stages - 1)
        if strides is not None and tuple(strides) != expected_strides:
            raise ValueError(f'strides={tuple(strides)} is not supported: Swin uses the patch '
                             f'size then 2x patch merging, i.e. {expected_strides}')
        out_indices = int_tuple(out_indices, 'out_indices')
        if not out_indices or any(not 0 <= i < num_stages for i in out_indices):
            raise ValueError(f'out_indices={out_indices} must be a non-empty subset of stage '
                             f'indices 0..{num_stages - 1}')
        if len(set(out_indices)) != len(out_indices):
            raise ValueError(f'out_indices={out_indices} has duplicates')
        # outputs come in stage order (as mmdet's), and so does the declared contract
        out_indices = tuple(sorted(out_indices))
        if not isinstance(frozen_stages, int) or isinstance(frozen_stages, bool):
            raise TypeError(f'frozen_stages must be an int in -1..{num_stages}, got '
                            f'{frozen_stages!r}')
        if self.embed_dims <= 0:
            raise ValueError(f'embed_dims must be positive, got {self.embed_dims}')
        if mlp_ratio <= 0:
            raise ValueError(f'mlp_ratio must be positive, got {mlp_ratio}')
        for name, rate in (('drop_rate', drop_rate), ('attn_drop_rate', attn_drop_rate),
                           ('drop_path_rate', drop_path_rate)):
            if not 0 <= rate < 1:
                raise ValueError(f'{name} must be in [0, 1), got {rate}')
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{num_stages} '
                             '(-1: train all, 0: patch embedding, k: also the first k stages)')
        norm_cfg = norm_cfg or dict(type='LN')
        act_cfg = act_cfg or dict(type='GELU')
        self.out_indices = out_indices
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.convert_weights = convert_weights
        self.in_channels = in_channels

        stem = (ConvStem(in_channels, stem_channels, stem_norm_cfg) if len(stem_channels)
                else None)
        self.patch_embed = PatchEmbed(patch_size, in_channels, self.embed_dims,
                                      build_norm_layer(norm_cfg, self.embed_dims)[1]
                                      if patch_norm else None, stem=stem)
        self.use_abs_pos_embed = use_abs_pos_embed
        if use_abs_pos_embed:
            grid = tuple(s // patch_size for s in to_2tuple(pretrain_img_size))
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, self.embed_dims, *grid))
        self.drop_after_pos = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()

        rates = linear_drop_path_rates(drop_path_rate, sum(self.depths))
        self.layers = nn.ModuleList()
        for i, depth in enumerate(self.depths):
            start = sum(self.depths[:i])
            self.layers.append(SwinStage(
                dims[i], depth, self.num_heads[i], self.window_size,
                drop_paths=rates[start:start + depth], downsample=i < num_stages - 1,
                norm_cfg=norm_cfg, with_cp=with_cp, merge_norm=patch_norm, mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop_rate, attn_drop=attn_drop_rate,
                act_cfg=act_cfg, fused_attn=fused_attn))
        for i in out_indices:
            self.add_module(f'norm{i}', build_norm_layer(norm_cfg, dims[i])[1])

        self.num_features: Tuple[int, ...] = tuple(dims)
        self.out_channels: Tuple[int, ...] = tuple(dims[i] for i in out_indices)
        self.out_strides: Tuple[int, ...] = tuple(patch_size * 2**i for i in out_indices)
        self._freeze_stages()

    # ------------------------------------------------------------------ freezing
    def frozen_modules(self) -> List[nn.Module]:
        mods: List[nn.Module] = []
        if self.frozen_stages >= 0:
            mods += [self.patch_embed, self.drop_after_pos]
        for i in range(self.frozen_stages):
            mods.append(self.layers[i])
            if i in self.out_indices:
                mods.append(getattr(self, f'norm{i}'))
        return mods

    def frozen_parameters(self) -> List[nn.Parameter]:
        return [self.absolute_pos_embed] if self.frozen_stages >= 0 and self.use_abs_pos_embed \
            else []

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """Truncated-normal init, or load ``init_cfg.checkpoint`` through the converters."""
        pretrained = pretrained_init_cfg(self.init_cfg)
        if pretrained is not None:
            load_swin_pretrained(self, pretrained['checkpoint'], prefix=pretrained.get('prefix'),
                                 src_window_size=pretrained.get('src_window_size'))
            self._is_init = True
            return
        if self.use_abs_pos_embed:
            trunc_normal_(self.absolute_pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, WindowAttention):
                trunc_normal_(m.relative_position_bias_table, std=0.02)
        self._is_init = True

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> maps ``(B, C_i, ceil(H / s_i), ceil(W / s_i))``."""
        x = self.patch_embed(x)                                     # (B, H, W, C)
        if self.use_abs_pos_embed:
            pos = F.interpolate(self.absolute_pos_embed, size=x.shape[1:3], mode='bicubic',
                                align_corners=False)
            x = x + pos.permute(0, 2, 3, 1)
        x = self.drop_after_pos(x)
        outs = []
        for i, stage in enumerate(self.layers):
            out, x = stage(x, consume_input=True)
            if i in self.out_indices:
                outs.append(_norm_to_nchw(getattr(self, f'norm{i}'), out))
        return tuple(outs)


def _norm_to_nchw(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm`` over channels of ``(B, H, W, C)``, returned as ``(B, C, H, W)`` (contiguous).

    Without autograd the rows are normalised in chunks written straight into the NCHW result,
    instead of materialising the normalised NHWC map first.
    """
    if not inference_fast_path(x):
        return norm(x).permute(0, 3, 1, 2).contiguous()
    b, h, w, c = x.shape
    out = x.new_empty(b, c, h, w)
    map_height_chunks(norm, x, out.permute(0, 2, 3, 1))
    return out
