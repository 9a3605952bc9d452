"""Swin Transformer backbone with detection semantics (Swin-Transformer-Object-Detection / mmdet).

Patch partition + linear embedding, stages of alternating W-MSA / SW-MSA blocks with a
relative-position bias and the shifted-window mask, patch merging between stages, and a
LayerNorm per output. Any input size works: the image is padded to the patch size and each
block pads its input to the window size (zeros at the bottom/right), so an ``H x W`` input gives
stride-``s`` maps of ``ceil(H / s) x ceil(W / s)``.

Parameter names follow the official Microsoft layout (``layers.{i}.blocks.{j}...``, downsample
at the end of stage ``i``), so official checkpoints load without renaming; other layouts are
converted by :mod:`vitdet_plugin.weights.swin`.

This file is the model's one path. On the CPU, ``accel='auto'`` swaps in measured kernels
(:mod:`..accel`): chunked in-place inference, and recomputing backwards of attention and GELU.
"""
import numbers
import re
from functools import partial
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer, build_norm_layer
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...functional import pad_to_multiple, window_partition, window_reverse, window_shift_mask
from ...weights.swin import load_swin_pretrained
from ..accel import (check_accel, padding_free_window_attention, plan_for_tensor,
                     swin_chunked_inference)
from ..layers import (ConvStem, DropPath, Mlp, PatchEmbed, PatchMerging, WindowAttention,
                      check_flags, check_rates, int_tuple, linear_drop_path_rates, positive_int,
                      positive_number, to_2tuple)
from ..layers.arguments import ArgumentError
from .archs import SWIN_ARCHS, SwinArch  # noqa: F401  (SWIN_ARCHS: re-exported)
from .base import (TRUNC_NORMAL_STD, BackboneContract, init_cfg_from_pretrained,
                   init_transformer_weights_, pretrained_init_cfg, run_blocks)




class SwinBlock(nn.Module):
    """One Swin block on ``(B, H, W, C)``: (shifted) window attention, then an MLP.

    Args:
        dim, num_heads: channels and attention heads.
        window_size: ``(wh, ww)``.
        shift: shift the windows by half a window (SW-MSA) instead of W-MSA.
        mlp_ratio: MLP hidden width / ``dim``.
        drop_path: stochastic-depth rate of this block.
        norm_cfg, act_cfg: mmcv config dicts for the norms and the MLP activation.
        accel: see :class:`SwinBackbone`.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int], shift: bool,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None, fused_attn: bool = True,
                 accel: str = 'off') -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.norm1 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        self.attn = WindowAttention(dim, num_heads, window_size, qkv_bias, qk_scale, attn_drop,
                                    drop, fused_attn, accel)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop, accel=accel)

    @property
    def shifted(self) -> bool:
        return any(self.shift_size)

    def window_attention(self, x: Tensor) -> Tensor:
        """(S)W-MSA of the normalised map ``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        b, h, w, c = x.shape
        shifts = (-self.shift_size[0], -self.shift_size[1])
        windows = pad_to_multiple(x, self.window_size)               # (B, Hp, Wp, C), zeros
        hp, wp = windows.shape[1:3]
        mask = None
        if self.shifted:  # detection semantics: always shift, also in a single window
            windows = torch.roll(windows, shifts, dims=(1, 2))
            mask = window_shift_mask((hp, wp), self.window_size, self.shift_size, x.device,
                                     self.attn.relative_position_bias_table.dtype)  # (nW, N, N)
        windows = window_partition(windows, self.window_size)        # (B * nW, N, C)
        windows = self.attn(windows, mask)                           # (B * nW, N, C)
        out = window_reverse(windows, self.window_size, (hp, wp))    # (B, Hp, Wp, C)
        if self.shifted:
            out = torch.roll(out, (-shifts[0], -shifts[1]), dims=(1, 2))
        return out[:, :h, :w]                                        # (B, H, W, C)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        if plan_for_tensor(x, self.attn.accel).compiled:  # see accel.padding_free
            out = padding_free_window_attention(self.norm1(x), self.attn, self.window_size,
                                                self.shift_size,
                                                self.attn.relative_position_bias_table.dtype)
        else:
            out = self.window_attention(self.norm1(x))
        x = x + self.drop_path(out)                                  # (B, H, W, C)
        return x + self.drop_path(self.mlp(self.norm2(x)))


class WindowStage(nn.Module):
    """A Swin stage's forward: its blocks in turn, then optional patch merging. Subclasses
    build ``blocks``, ``downsample`` and ``with_cp``."""

    blocks: nn.ModuleList
    downsample: Optional[nn.Module]
    with_cp: bool

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``(B, H, W, C)`` -> (stage output ``(B, H, W, C)``, input of the next stage)."""
        x = run_blocks(self.blocks, x, self.with_cp, self.training)
        return x, (self.downsample(x) if self.downsample is not None else x)


class SwinStage(WindowStage):
    """``depth`` blocks alternating W-MSA / SW-MSA, then optional patch merging."""

    def __init__(self, dim: int, depth: int, num_heads: int, window_size: Tuple[int, int],
                 drop_paths: Sequence[float], downsample: bool, norm_cfg: dict,
                 with_cp: bool = False, merge_norm: bool = True, **block_kwargs) -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2)
        self.with_cp = with_cp
        self.blocks = nn.ModuleList([
            SwinBlock(dim, num_heads, window_size, shift=(j % 2 == 1), drop_path=drop_paths[j],
                      norm_cfg=norm_cfg, **block_kwargs) for j in range(depth)])
        merge_norm_layer = build_norm_layer(norm_cfg, 4 * dim)[1] if merge_norm else nn.Identity()
        self.downsample = PatchMerging(dim, merge_norm_layer) if downsample else None


@MODELS.register_module()
class SwinBackbone(BackboneContract, BaseModule):
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
        stem_channels: optional convolutional stem (:class:`~..layers.ConvStem`, one ``3x3``
            stride-2 conv + norm + ReLU per entry) before a patch projection covering the rest
            of ``patch_size``; for training from scratch (no published weights).
        stem_norm_cfg: norm config of the stem's convolutions (default BN).
        out_indices: stages whose outputs are returned (each through its own norm).
        frozen_stages: ``-1`` trains everything; ``0`` freezes the patch embedding (and the
            absolute position embedding); ``k >= 1`` also stages ``0..k-1`` and their output
            norms (``requires_grad=False``, kept in eval mode).
        norm_eval: keep every norm layer in eval mode during training.
        with_cp: activation checkpointing per block (non-reentrant).
        fused_attn: attention through ``F.scaled_dot_product_attention`` (False: eager).
        accel: ``'auto'`` (default) uses our CPU kernels on the CPU and the plain path
            elsewhere; ``'off'`` the plain path everywhere (see :mod:`..accel`).
        norm_cfg, act_cfg: mmcv config dicts.
        strides: accepted for mmdet-config compatibility; must equal ``(patch_size, 2, ...)``.
        convert_weights: accepted for mmdet-config compatibility (formats are detected).
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` loads official, Swin detection,
            timm, mmdet/mmpretrain or our own checkpoints (format detected, weights_only; a
            path, ``~`` path or http(s) URL; optional ``prefix`` and, for a checkpoint with a
            rectangular window, ``src_window_size=(h, w)``).
    """

    NO_DECAY_PARAMS = ('absolute_pos_embed', 'relative_position_bias_table')

    depths: Tuple[int, ...]
    out_indices: Tuple[int, ...]
    frozen_stages: int
    accel: str
    use_abs_pos_embed: bool
    absolute_pos_embed: nn.Parameter
    patch_embed: PatchEmbed
    drop_after_pos: nn.Module
    layers: nn.ModuleList

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
                 accel: str = 'auto',
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 strides: Optional[Sequence[int]] = None,
                 convert_weights: bool = True,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        spec = SwinArch.resolve(arch, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        self.embed_dims, self.depths, self.num_heads = spec.embed_dims, spec.depths, spec.num_heads
        num_stages = len(self.depths)
        dims = [self.embed_dims * 2**i for i in range(num_stages)]
        self.in_channels = positive_int(in_channels, 'in_channels')
        positive_int(patch_size, 'patch_size', ' (the first output stride)')
        self.window_size = to_2tuple(window_size, 'window_size')
        if min(self.window_size) <= 0:
            raise ValueError(f'window_size must be positive, got {window_size!r}')
        expected_strides = (patch_size,) + (2,) * (num_stages - 1)
        if strides is not None and tuple(strides) != expected_strides:
            raise ArgumentError(f'strides={tuple(strides)} is not supported: Swin uses the '
                                f'patch size then 2x patch merging, i.e. {expected_strides}')
        out_indices = int_tuple(out_indices, 'out_indices')
        if not out_indices or any(not 0 <= i < num_stages for i in out_indices):
            raise ValueError(f'out_indices={out_indices} must be a non-empty subset of stage '
                             f'indices 0..{num_stages - 1}')
        if len(set(out_indices)) != len(out_indices):
            raise ValueError(f'out_indices={out_indices} has duplicates')
        self.out_indices = tuple(sorted(out_indices))  # stage order, as mmdet's outputs
        if not isinstance(frozen_stages, int) or isinstance(frozen_stages, bool):
            raise TypeError(f'frozen_stages must be an int in -1..{num_stages}, got '
                            f'{frozen_stages!r}')
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{num_stages} '
                             '(-1: train all, 0: patch embedding, k: also the first k stages)')
        positive_number(mlp_ratio, 'mlp_ratio')
        if qk_scale is not None and (not isinstance(qk_scale, numbers.Real) or qk_scale < 0):
            raise ValueError(f'qk_scale must be None or a non-negative number (0: the default '
                             f'head_dim ** -0.5), got {qk_scale!r}')
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                    drop_path_rate=drop_path_rate)
        check_flags(qkv_bias=qkv_bias, use_abs_pos_embed=use_abs_pos_embed,
                    patch_norm=patch_norm, norm_eval=norm_eval, with_cp=with_cp,
                    fused_attn=fused_attn, convert_weights=convert_weights)
        self.accel = check_accel(accel)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.convert_weights = convert_weights
        norm_cfg = norm_cfg or dict(type='LN')

        stem = ConvStem(in_channels, stem_channels, stem_norm_cfg) if len(stem_channels) else None
        patch_norm_layer = build_norm_layer(norm_cfg, self.embed_dims)[1] if patch_norm else None
        self.patch_embed = PatchEmbed(patch_size, in_channels, self.embed_dims, patch_norm_layer,
                                      stem=stem)
        self.use_abs_pos_embed = use_abs_pos_embed
        pretrain_hw = to_2tuple(pretrain_img_size, 'pretrain_img_size')  # checked either way
        if use_abs_pos_embed:
            grid = tuple(s // patch_size for s in pretrain_hw)
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
                act_cfg=act_cfg, fused_attn=fused_attn, accel=accel))
        for i in self.out_indices:
            self.add_module(f'norm{i}', build_norm_layer(norm_cfg, dims[i])[1])

        self.num_features: Tuple[int, ...] = tuple(dims)
        self.out_channels = tuple(dims[i] for i in self.out_indices)
        self.out_strides = tuple(patch_size * 2**i for i in self.out_indices)
        self.num_layers = sum(self.depths)
        self._freeze_stages()

    # ------------------------------------------------------------------ contract
    def layer_id(self, name: str) -> int:
        """mmpretrain's rule: embeddings 0, ``layers.i.blocks.j`` ``sum(depths[:i]) + j + 1``,
        a stage's downsample with its last block, everything else ``num_layers + 1``."""
        if name.startswith(('patch_embed.', 'absolute_pos_embed')):
            return 0
        m = re.match(r'^layers\.(\d+)\.(blocks\.(\d+)|downsample)\.', name)
        if m is None:
            return self.num_layers + 1
        stage = int(m.group(1))
        if m.group(3) is None:
            return sum(self.depths[:stage + 1])
        return sum(self.depths[:stage]) + int(m.group(3)) + 1

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
        if self.frozen_stages >= 0 and self.use_abs_pos_embed:
            return [self.absolute_pos_embed]
        return []

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
            trunc_normal_(self.absolute_pos_embed, std=TRUNC_NORMAL_STD)
        init_transformer_weights_(self)
        for m in self.modules():
            if isinstance(m, WindowAttention):
                trunc_normal_(m.relative_position_bias_table, std=TRUNC_NORMAL_STD)
        self._is_init = True

    # ------------------------------------------------------------------ forward
    def embed(self, x: Tensor) -> Tensor:
        """Images ``(B, C_in, H, W)`` -> tokens ``(B, H/p, W/p, C)`` (+ position embedding)."""
        x = self.patch_embed(x)                                      # (B, h, w, C)
        if self.use_abs_pos_embed:
            pos = F.interpolate(self.absolute_pos_embed, size=x.shape[1:3], mode='bicubic',
                                align_corners=False)                 # (1, C, h, w)
            x = x + pos.permute(0, 2, 3, 1)
        return self.drop_after_pos(x)

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> maps ``(B, C_i, ceil(H / s_i), ceil(W / s_i))``."""
        if not self.training and plan_for_tensor(x, self.accel).chunked_inference:
            return swin_chunked_inference(self, x)
        x = self.embed(x)
        outs = []
        for i, stage in enumerate(self.layers):
            out, x = stage(x)                                        # (B, H_i, W_i, C_i)
            if i in self.out_indices:
                norm = getattr(self, f'norm{i}')
                outs.append(norm(out).permute(0, 3, 1, 2).contiguous())  # (B, C_i, H_i, W_i)
        return tuple(outs)
