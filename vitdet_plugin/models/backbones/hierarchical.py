"""The hierarchical window backbone that Swin V1 and V2 share: the patch embedding (optional
conv stem and absolute position embedding), the stage loop with patch merging between stages, a
norm per output (official names: ``layers.{i}.blocks.{j}``, ``layers.{i}.downsample``,
``norm{i}``), layer ids, freezing and ``with_cp``. A subclass passes its block and merging
factories."""
import re
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.sizes import to_2tuple
from ..layers.arguments import check_flags, check_rates, int_tuple, positive_int
from ..layers.patch_embed import ConvStem, PatchEmbed
from ..layers.drop_path import linear_drop_path_rates
from .base import BackboneContract, run_blocks
from .swin_archs import SwinArch

#: ``block(stage, index, dim, num_heads, drop_path)``: block ``index`` of stage ``stage``,
#: ``(B, H, W, dim)`` -> the same.
BlockFactory = Callable[[int, int, int, int, float], nn.Module]
#: ``merge(dim)``: the patch merging at the end of a stage of ``dim`` channels.
MergeFactory = Callable[[int], nn.Module]


class WindowStage(nn.Module):
    """A stage: its blocks in turn, then optional patch merging (no parameters of its own)."""

    def __init__(self, blocks: Sequence[nn.Module], downsample: Optional[nn.Module],
                 with_cp: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample
        self.with_cp = with_cp

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``(B, H, W, C)`` -> (stage output ``(B, H, W, C)``, input of the next stage)."""
        x = run_blocks(self.blocks, x, self.with_cp, self.training)
        return x, (self.downsample(x) if self.downsample is not None else x)


class WindowBackbone(BackboneContract, BaseModule):
    """Patch embedding, stages of ``block`` s with ``merge`` between them, a norm per output;
    the other arguments are documented at :class:`~.swin.SwinBackbone`."""

    def __init__(self, spec: SwinArch, block: BlockFactory, merge: MergeFactory, *,
                 in_channels: int, patch_size: int, out_indices: Sequence[int],
                 frozen_stages: int, drop_rate: float, drop_path_rate: float, patch_norm: bool,
                 norm_eval: bool, with_cp: bool, norm_cfg: dict, stem_channels: Sequence[int] = (),
                 stem_norm_cfg: Optional[dict] = None, use_abs_pos_embed: bool = False,
                 pretrain_img_size: object = 224, init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.embed_dims, self.depths, self.num_heads = spec.embed_dims, spec.depths, spec.num_heads
        num_stages = len(self.depths)
        dims = [self.embed_dims * 2**i for i in range(num_stages)]
        self.in_channels = positive_int(in_channels, 'in_channels')
        positive_int(patch_size, 'patch_size', ' (the first output stride)')
        self.out_indices = self._check_out_indices(out_indices, num_stages)
        if not isinstance(frozen_stages, int) or isinstance(frozen_stages, bool):
            raise TypeError(f'frozen_stages must be an int in -1..{num_stages}, got '
                            f'{frozen_stages!r}')
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{num_stages} '
                             '(-1: train all, 0: patch embedding, k: also the first k stages)')
        check_rates(drop_rate=drop_rate, drop_path_rate=drop_path_rate)
        check_flags(use_abs_pos_embed=use_abs_pos_embed, patch_norm=patch_norm,
                    norm_eval=norm_eval, with_cp=with_cp)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval

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
            blocks = [block(i, j, dims[i], self.num_heads[i], rates[start + j])
                      for j in range(depth)]
            downsample = merge(dims[i]) if i < num_stages - 1 else None
            self.layers.append(WindowStage(blocks, downsample, with_cp))
        for i in self.out_indices:
            self.add_module(f'norm{i}', build_norm_layer(norm_cfg, dims[i])[1])

        self.num_features: Tuple[int, ...] = tuple(dims)
        self.out_channels = tuple(dims[i] for i in self.out_indices)
        self.out_strides = tuple(patch_size * 2**i for i in self.out_indices)
        self.num_layers = sum(self.depths)
        self._freeze_stages()

    @staticmethod
    def _check_out_indices(out_indices: Sequence[int], num_stages: int) -> Tuple[int, ...]:
        indices = int_tuple(out_indices, 'out_indices')
        if not indices or any(not 0 <= i < num_stages for i in indices):
            raise ValueError(f'out_indices={indices} must be a non-empty subset of stage '
                             f'indices 0..{num_stages - 1}')
        if len(set(indices)) != len(indices):
            raise ValueError(f'out_indices={indices} has duplicates')
        return tuple(sorted(indices))  # stage order, as mmdet's outputs

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

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> maps ``(B, C_i, ceil(H / s_i), ceil(W / s_i))``."""
        x = self.patch_embed(x)                                      # (B, h, w, C)
        if self.use_abs_pos_embed:
            pos = F.interpolate(self.absolute_pos_embed, size=x.shape[1:3], mode='bicubic',
                                align_corners=False)                 # (1, C, h, w)
            x = x + pos.permute(0, 2, 3, 1)
        x = self.drop_after_pos(x)
        outs = []
        for i, stage in enumerate(self.layers):
            out, x = stage(x)                                        # out: (B, H_i, W_i, C_i)
            if i in self.out_indices:
                norm = getattr(self, f'norm{i}')
                outs.append(norm(out).permute(0, 3, 1, 2).contiguous())  # (B, C_i, H_i, W_i)
        return tuple(outs)
