"""The plain ViT shared by ViTDet, DINOv2, DINOv3 and EVA-02: one backbone, one block, one forward.

``x -> patch_embed -> [+ pos_embed] -> [cls, registers, patches] -> blocks -> [norm] -> maps``:
the patch tokens of the ``out_indices`` blocks as ``(B, C, h, w)`` maps at stride
``patch_size``, for the simple pyramid neck ``ViTSimpleFPN``. Each family is a subclass in its
own module; ``rope_coords`` and ``prefix_tokens`` are explained in docs/backbones.md.
"""
import dataclasses
import re
from typing import Any, Callable, ClassVar, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn

from ...functional.pos_grid import resize_pos_grid
from ...functional.rope import RopeSpec, check_rope_spec, rope_tables
from ...functional.sizes import SizeCache, to_2tuple, window_pair
from ...functional.window import padded_size, window_partition
from ...functional.checkpoint_target import CheckpointTarget
from ..layers.arguments import (check_flags, check_rates, positive_int, positive_number,
                                refuse_removed)
from ..layers.patch_embed import ConvStem, PatchEmbed
from ..layers.drop_path import linear_drop_path_rates
from .base import (TRUNC_NORMAL_STD, BackboneContract, init_cfg_from_pretrained,
                   init_transformer_weights_, load_init_checkpoint, run_blocks,
                   state_shapes)
from .vit_archs import PlainViTArch, check_frozen_blocks, check_out_indices
from .vit_block import RopeTables, TokenLayout, ViTBlock

#: Where window blocks take their rotary coordinates from.
ROPE_COORDS = ('window', 'global')
#: What happens to the cls / register tokens.
PREFIX_TOKENS = ('keep', 'drop')
#: ``rope=FAMILY_DEFAULT``: the family's rotary settings (:attr:`PlainViTBackbone.ROPE`).
FAMILY_DEFAULT = 'family'
_WINDOW_TABLES: SizeCache[RopeTables] = SizeCache()
#: Builds block ``index``: ``make_block(index, **block_args)``, ``block_args`` being
#: :class:`ViTBlock`'s (``window_size`` None: a global block).
BlockFactory = Callable[..., nn.Module]


def plain_block(index: int, **block_args: Any) -> nn.Module:
    """The same :class:`ViTBlock` at every index (DINOv2, DINOv3, EVA-02)."""
    return ViTBlock(**block_args)


def patch_grid(size: Union[int, Tuple[int, int]], name: str, patch: int) -> Tuple[int, int]:
    """The ``(h, w)`` patch grid of an image size (int or pair): at least one patch a side."""
    h, w = to_2tuple(size, name)
    if min(h, w) < patch:
        raise ValueError(f'{name}={size!r} is smaller than the patch ({patch} pixels): the grid '
                         'it describes would be empty; give the image size (at least one '
                         'patch per side)')
    return h // patch, w // patch


class PlainViTBackbone(BackboneContract, BaseModule):
    """The plain ViT (see the module docstring); build a registered family.

    Args:
        arch: a preset of the family (:attr:`ARCH`), a dict of its fields or a resolved spec;
            ``embed_dims``, ``depth``, ``num_heads``, ``global_attn_indexes`` (blocks with
            global attention, ``range(depth)``: all), ``drop_path_rate``, ``num_reg_tokens``,
            ``qkv_bias`` and ``mlp_ratio`` override it.
        in_channels: image channels.
        patch_size: any patch size (checkpoint kernels are resampled); default the family's.
        stem_channels, stem_norm_cfg: optional :class:`~..layers.ConvStem` before the patch
            projection.
        window_size: the window of the window blocks (int or ``(h, w)``).
        use_abs_pos, pretrain_img_size, pretrain_patch_size, pretrain_use_cls_token: absolute
            position embedding, its stored grid (default the family's, e.g. DINOv2 518 / 14) and
            cls slot.
        rope: ``dict(temperature=..., ref_grid=(h, w))`` (``ref_grid``: EVA-02's pretraining
            token grid), default the family's; None only for a family without rope.
        rope_coords: ``'window'`` or ``'global'`` rotary coordinates in window blocks.
        prefix_tokens: ``'keep'`` or ``'drop'`` the cls / register tokens.
        out_indices: blocks whose patch tokens are returned (default: the last).
        final_norm: a final norm on every output (timm's ``forward_features``); default the
            family's (DINOv2 / DINOv3: yes; ViTDet, EVA-02: no).
        frozen_stages: ``-1`` trains all; ``k >= 0`` freezes the embeddings, tokens and first
            ``k`` blocks. with_cp: activation checkpointing per block.
        norm_cfg, act_cfg: the blocks' norms (default LayerNorm, the arch's eps) and GELU
            MLP activation.
        drop_rate, attn_drop_rate: dropout after the projections / on the attention weights.
        pretrained: deprecated spelling of ``init_cfg=dict(type='Pretrained', checkpoint=...)``.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH[, prefix=...])`` loads a
            checkpoint of this family in any of its layouts (:mod:`vitdet_plugin.weights`).
        make_block: builds each block (:data:`BlockFactory`; ViTDet's adds its extras).
        removed: removed options (``accel``, ``fused_attn``): an error names the fix.
    """

    ARCH: ClassVar[Type[PlainViTArch]] = PlainViTArch
    FAMILY = ''
    DEFAULT_PATCH = 16
    DEFAULT_WINDOW = 14
    DEFAULT_PRETRAIN_IMG = 224
    USE_ABS_POS = True
    #: Resize the position grid as timm's DINOv2 / EVA-02 (antialiased bicubic) or plain
    #: bicubic (ViTDet).
    POS_ANTIALIAS = True
    #: Final norm on the outputs by default (timm's ``forward_features`` has one).
    FINAL_NORM = True
    #: Rotary formulation (None: no rope) and its default settings.
    ROPE_FORMULATION: Optional[str] = None
    ROPE: ClassVar[Optional[Mapping]] = None
    NO_DECAY_PARAMS: ClassVar[Tuple[str, ...]] = ('pos_embed', 'cls_token', 'reg_token', 'gamma')

    def __init__(self,
                 arch: Union[str, dict, PlainViTArch, None] = 'base',
                 embed_dims: Optional[int] = None,
                 depth: Optional[int] = None,
                 num_heads: Optional[int] = None,
                 global_attn_indexes: Optional[Sequence[int]] = None,
                 drop_path_rate: Optional[float] = None,
                 num_reg_tokens: Optional[int] = None,
                 qkv_bias: Optional[str] = None,
                 mlp_ratio: Optional[float] = None,
                 in_channels: int = 3,
                 patch_size: Optional[int] = None,
                 stem_channels: Sequence[int] = (),
                 stem_norm_cfg: Optional[dict] = None,
                 window_size: Union[int, Tuple[int, int], None] = None,
                 pretrain_img_size: Union[int, Tuple[int, int], None] = None,
                 pretrain_patch_size: Optional[int] = None,
                 pretrain_use_cls_token: bool = True,
                 use_abs_pos: Optional[bool] = None,
                 rope: Union[dict, str, None] = FAMILY_DEFAULT,
                 rope_coords: str = 'window',
                 prefix_tokens: str = 'keep',
                 out_indices: Sequence[int] = (-1,),
                 final_norm: Optional[bool] = None,
                 drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0,
                 frozen_stages: int = -1,
                 with_cp: bool = False,
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 pretrained: Optional[str] = None,
                 init_cfg: Optional[dict] = None,
                 make_block: BlockFactory = plain_block,
                 **removed: object) -> None:
        name = type(self).__name__
        refuse_removed(name, removed)
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        if not self.FAMILY:
            raise TypeError('PlainViTBackbone is the shared base: build ViTBackbone, '
                            'DINOv2Backbone, DINOv3Backbone or EVA02Backbone')
        spec: PlainViTArch = arch if isinstance(arch, self.ARCH) else self.ARCH.resolve(
            arch, embed_dims=embed_dims, depth=depth, num_heads=num_heads,
            global_attn_indexes=global_attn_indexes, drop_path_rate=drop_path_rate,
            num_reg_tokens=num_reg_tokens, qkv_bias=qkv_bias, mlp_ratio=mlp_ratio)
        self.arch = spec
        self.embed_dims, self.depth, self.num_heads = spec.embed_dims, spec.depth, spec.num_heads
        self.global_attn_indexes: Tuple[int, ...] = spec.global_attn_indexes or ()
        self.patch_size = positive_int(self.DEFAULT_PATCH if patch_size is None else patch_size,
                                       'patch_size')
        self.in_channels = positive_int(in_channels, 'in_channels')
        self.window_size = window_pair(
            self.DEFAULT_WINDOW if window_size is None else window_size, 'window_size',
            '; for global attention in every block give global_attn_indexes=range(depth)')
        self.rope_spec = self._rope_spec(rope)
        if rope_coords not in ROPE_COORDS:
            raise ValueError(f'rope_coords={rope_coords!r} is not one of {list(ROPE_COORDS)} '
                             "('window': each window its own grid, as EVA-02-det; 'global': "
                             'the full grid partitioned into windows)')
        if prefix_tokens not in PREFIX_TOKENS:
            raise ValueError(f'prefix_tokens={prefix_tokens!r} is not one of '
                             f"{list(PREFIX_TOKENS)} ('keep': every window attends to the cls "
                             "/ register tokens; 'drop': removed after the embedding)")
        self.rope_coords, self.prefix_tokens = rope_coords, prefix_tokens
        self.out_indices = check_out_indices(out_indices, self.depth)
        check_frozen_blocks(frozen_stages, self.depth)
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate)
        final_norm = self.FINAL_NORM if final_norm is None else final_norm
        use_abs_pos = self.USE_ABS_POS if use_abs_pos is None else use_abs_pos
        check_flags(final_norm=final_norm, with_cp=with_cp, use_abs_pos=use_abs_pos,
                    pretrain_use_cls_token=pretrain_use_cls_token)
        self.frozen_stages, self.with_cp, self.final_norm = frozen_stages, with_cp, final_norm
        keep = prefix_tokens == 'keep'

        dims = self.embed_dims
        stem = ConvStem(in_channels, stem_channels, stem_norm_cfg) if len(stem_channels) else None
        self.patch_embed = PatchEmbed(self.patch_size, in_channels, dims, stem=stem)
        # 'drop': no cls / register parameters (no gradient: DDP would wait for them)
        self.num_prefix = 1 + spec.num_reg_tokens if keep else 0
        self.cls_token: Optional[nn.Parameter] = (
            nn.Parameter(torch.zeros(1, 1, dims)) if keep else None)
        self.reg_token: Optional[nn.Parameter] = (
            nn.Parameter(torch.zeros(1, spec.num_reg_tokens, dims))
            if keep and spec.num_reg_tokens else None)
        self.num_pos_prefix = int(pretrain_use_cls_token)
        self.pos_embed: Optional[nn.Parameter] = None
        self.pretrain_grid: Optional[Tuple[int, int]] = None
        if use_abs_pos:
            # the checkpoint's grid, whatever patch this model runs with
            stored_patch = positive_int(self.DEFAULT_PATCH if pretrain_patch_size is None
                                        else pretrain_patch_size, 'pretrain_patch_size')
            self.pretrain_grid = patch_grid(self.DEFAULT_PRETRAIN_IMG if pretrain_img_size is None
                                            else pretrain_img_size, 'pretrain_img_size',
                                            stored_patch)
            n = self.num_pos_prefix + self.pretrain_grid[0] * self.pretrain_grid[1]
            self.pos_embed = nn.Parameter(torch.zeros(1, n, dims))
        elif pretrain_img_size is not None or pretrain_patch_size is not None:
            rotary = ' (rotary only)' if self.rope_spec is not None else ''
            raise ValueError(f'{name} has no absolute position embedding{rotary}: remove '
                             'pretrain_img_size / pretrain_patch_size')

        rates = linear_drop_path_rates(spec.drop_path_rate, self.depth)
        rotate_half = self.rope_spec is not None and self.rope_spec.rotate_half
        self.blocks = nn.ModuleList(
            make_block(i, spec=spec, rotate_half=rotate_half, drop=drop_rate,
                       attn_drop=attn_drop_rate, drop_path=rates[i], norm_cfg=norm_cfg,
                       act_cfg=act_cfg,
                       window_size=None if i in self.global_attn_indexes else self.window_size)
            for i in range(self.depth))
        self.norm = nn.LayerNorm(dims, eps=spec.norm_eps) if final_norm else None
        self.out_channels = (dims,) * len(self.out_indices)
        self.out_strides = (self.patch_size,) * len(self.out_indices)
        self.num_layers = self.depth
        self._freeze_stages()

    def _rope_spec(self, rope_arg: Union[dict, str, None]) -> Optional[RopeSpec]:
        name, family = type(self).__name__, self.ROPE
        rope = family if rope_arg == FAMILY_DEFAULT else rope_arg
        if self.ROPE_FORMULATION is None or family is None:
            if rope is not None:
                raise ValueError(f'{name} has no rotary position embedding ({self.FAMILY} '
                                 f'uses an absolute one): remove rope={rope!r}')
            return None
        keys = sorted(family)
        if not isinstance(rope, dict) or sorted(rope) != keys:
            raise ValueError(f'{name} needs its rotary settings: rope={rope!r} must be a dict '
                             f'with exactly {keys} ({self.FAMILY} checkpoints: rope={family!r})')
        ref = rope.get('ref_grid')
        spec = RopeSpec(self.ROPE_FORMULATION, self.embed_dims // self.num_heads,
                        float(positive_number(rope['temperature'], 'rope temperature')),
                        None if ref is None else to_2tuple(ref, 'rope ref_grid'))
        return check_rope_spec(spec)

    def layer_id(self, name: str) -> int:
        """Embeddings and tokens 0, block ``i`` ``i + 1``, the final norm and everything else
        ``num_layers + 1``."""
        if name.startswith(('patch_embed.', 'pos_embed', 'cls_token', 'reg_token')):
            return 0
        m = re.match(r'^blocks\.(\d+)\.', name)
        if m:
            return int(m.group(1)) + 1
        return self.num_layers + 1

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a checkpoint of this family for."""
        spec = self.rope_spec
        return CheckpointTarget(
            self.FAMILY, type(self).__name__, state_shapes(self), pos_grid=self.pretrain_grid,
            patch_size=(self.patch_size, self.patch_size),
            rope_temperature=None if spec is None else float(spec.temperature),
            rope_ref_grid=None if spec is None else spec.ref_grid, arch_presets=self.ARCH.PRESETS,
            arch_fields=dataclasses.asdict(self.arch))

    def init_weights(self) -> None:
        """Load the ``init_cfg`` checkpoint (any layout of this family in the layout table), or
        initialise as timm: trunc-normal(0.02) linears, position embedding and tokens."""
        if load_init_checkpoint(self):
            return
        init_transformer_weights_(self.blocks)
        for p in (self.pos_embed, self.cls_token, self.reg_token):
            if p is not None:
                trunc_normal_(p, std=TRUNC_NORMAL_STD)
        super().init_weights()

    def frozen_modules(self) -> List[nn.Module]:
        """The patch embedding, then the first ``frozen_stages`` blocks."""
        patch: List[nn.Module] = [self.patch_embed] if self.frozen_stages >= 0 else []
        return patch + list(self.blocks[:max(self.frozen_stages, 0)])

    def frozen_parameters(self) -> List[nn.Parameter]:
        if self.frozen_stages < 0:
            return []
        params = (self.pos_embed, self.cls_token, self.reg_token)
        return [p for p in params if p is not None]

    def abs_pos_embed(self, hw: Tuple[int, int]) -> Tensor:
        """The position embedding of an ``hw`` token grid, ``(1, h * w, C)``: the stored grid
        resized (bicubic; antialiased with :attr:`POS_ANTIALIAS`)."""
        assert self.pos_embed is not None and self.pretrain_grid is not None
        gh, gw = self.pretrain_grid
        grid = self.pos_embed[:, self.num_pos_prefix:].reshape(1, gh, gw, -1)  # (1, gh, gw, C)
        grid = resize_pos_grid(grid.permute(0, 3, 1, 2), hw, antialias=self.POS_ANTIALIAS)
        return grid.flatten(2).transpose(1, 2)                       # (1, h * w, C)

    def token_layout(self, hw: Tuple[int, int], device: torch.device,
                     dtype: torch.dtype) -> TokenLayout:
        """The grid, prefix count and rotary tables every block of this forward uses."""
        num_prefix, spec = self.num_prefix, self.rope_spec
        if spec is None:
            return TokenLayout(hw, num_prefix, None, None)
        table_dtype = dtype if dtype == torch.float64 else torch.float32
        sin, cos = rope_tables(spec, hw, device=device, dtype=table_dtype)  # (h * w, d)
        rope_global = (sin[None], cos[None])                         # (1, h * w, d)
        window = self.window_size
        if len(self.global_attn_indexes) == self.depth:
            rope_window = None
        elif self.rope_coords == 'window':
            sin_w, cos_w = rope_tables(spec, window, device=device, dtype=table_dtype)
            rope_window = (sin_w[None], cos_w[None])                 # (1, wh * ww, d)
        else:
            rope_window = _WINDOW_TABLES.get(
                (spec, hw, window, device, table_dtype),
                lambda: _partitioned_tables(spec, hw, window, device, table_dtype))
        return TokenLayout(hw, num_prefix, rope_global, rope_window)

    def embed(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
        """Image ``(B, C_in, H, W)`` -> tokens ``(B, P + h * w, C)`` and the grid ``(h, w)``."""
        x = self.patch_embed(x)                                      # (B, h, w, C)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)                                   # (B, h * w, C)
        if self.pos_embed is not None:
            x = x + self.abs_pos_embed((h, w))
        if self.cls_token is None:  # prefix_tokens='drop'
            return x, (h, w)
        cls: Tensor = self.cls_token                                 # (1, 1, C)
        if self.pos_embed is not None and self.num_pos_prefix:
            cls = cls + self.pos_embed[:, :1]
        prefix = [cls.expand(b, -1, -1)]                             # (B, 1, C)
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(b, -1, -1))          # (B, R, C)
        return torch.cat(prefix + [x], dim=1), (h, w)               # (B, P + h * w, C)

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> ``(B, C, ceil(H / p), ceil(W / p))`` per output index."""
        x, (h, w) = self.embed(x)                                    # (B, P + h * w, C)
        layout = self.token_layout((h, w), x.device, x.dtype)

        def block_fn(block: nn.Module, tokens: Tensor) -> Tensor:
            return block(tokens, layout)

        outs = []
        start = 0
        for end in self.out_indices:  # sorted: the blocks up to each output, in turn
            x = run_blocks(self.blocks[start:end + 1], x, self.with_cp, self.training, block_fn)
            patches = x[:, layout.num_prefix:]                       # (B, h * w, C)
            if self.norm is not None:
                patches = self.norm(patches)
            patches = patches.transpose(1, 2).reshape(x.shape[0], -1, h, w)  # (B, C, h, w)
            outs.append(patches.contiguous())
            start = end + 1
        return tuple(outs)


def _partitioned_tables(spec: RopeSpec, hw: Tuple[int, int], window: Tuple[int, int],
                        device: torch.device, dtype: torch.dtype) -> RopeTables:
    """The full grid's rotary tables over the padded map, cut into windows like the tokens:
    ``(nW, wh * ww, d)`` each (``rope_coords='global'``)."""
    padded = padded_size(hw, window)
    sin, cos = rope_tables(spec, hw, padded, device, dtype)          # (Hp * Wp, d)
    d = sin.shape[-1]
    return (window_partition(sin.reshape(1, *padded, d), window),
            window_partition(cos.reshape(1, *padded, d), window))    # (nW, N, d)


def family_docs(cls: Type[PlainViTBackbone]) -> Type[PlainViTBackbone]:
    """Append :class:`PlainViTBackbone`'s argument docs to a family's docstring, so that
    ``help(DINOv2Backbone)`` shows them."""
    base = PlainViTBackbone.__doc__ or ''
    cls.__doc__ = f"{cls.__doc__}\n\n{base[base.index('    Args:'):]}"
    return cls
