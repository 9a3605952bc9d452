"""The hybrid encoder of RT-DETR as D-FINE and DEIMv2 build it: per-level 1x1 projections, AIFI
(a transformer encoder layer with 2D sine-cosine positions on the coarsest level) and CCFM (a
top-down then bottom-up pyramid of CSP-ELAN fusion blocks, SCDown between levels).

D-FINE: concatenating fusion (``fuse_op='cat'``), RepNCSPELAN4 with D-FINE's CSP layers
(``version='dfine', csp_type='csp'``). DEIMv2: summing fusion; its HGNetV2 sizes keep
RepNCSPELAN4 with split CSP layers (``csp_type='csp2'``), its DINOv3 sizes drop the branch convs
(``version='deim'``: RepNCSPELAN5) and take the adapter's maps without projection
(``input_proj=False``).

Positions follow transformers' ``build_2d_sinusoidal_position_embedding``: ``[sin y, cos y,
sin x, cos x]`` over the row-major grid (the reference repositories' formula equals it on square
maps).
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.model import BaseModule
from torch import Tensor, nn

from ...functional.checkpoint_target import (CheckpointTarget, checkpoint_loader,
                                             pretrained_init_cfg)
from ...functional.sizes import SizeCache
from ..layers.arguments import check_flags, check_rate, int_tuple, positive_int
from ..layers.conv_blocks import ConvNorm, RepNCSPELAN, SCDown, make_activation

#: Fusion of two maps in the pyramid: concatenation (D-FINE) or sum (DEIMv2).
FUSE_OPS = ('cat', 'sum')
#: Fusion blocks: RepNCSPELAN4 (a 3x3 conv after each CSP branch) or RepNCSPELAN5 (none).
VERSIONS = {'dfine': True, 'deim': False}
#: RepVGG blocks per CSP layer at ``depth_mult=1``.
BASE_DEPTH = 3
#: Sine-cosine position tables, one per (grid, width, temperature, device, dtype).
_POS_TABLES: SizeCache[Tensor] = SizeCache()


def sincos_pos_embed(hw: Tuple[int, int], dim: int, temperature: float,
                     device: torch.device, dtype: torch.dtype) -> Tensor:
    """``(1, h * w, dim)``: ``[sin y, cos y, sin x, cos x]`` with ``dim / 4`` frequencies
    ``temperature ** (-i / (dim / 4))`` each, row-major; computed in float64, cached."""
    def build() -> Tensor:
        quarter = dim // 4
        omega = temperature ** -(torch.arange(quarter, dtype=torch.float64, device=device)
                                 / quarter)                          # (dim / 4,)
        ys, xs = torch.meshgrid(torch.arange(hw[0], dtype=torch.float64, device=device),
                                torch.arange(hw[1], dtype=torch.float64, device=device),
                                indexing='ij')                       # (h, w) each
        ey, ex = ys.flatten().outer(omega), xs.flatten().outer(omega)  # (h * w, dim / 4)
        table = torch.cat([ey.sin(), ey.cos(), ex.sin(), ex.cos()], dim=1)
        return table.to(dtype)[None]                                 # (1, h * w, dim)
    return _POS_TABLES.get((hw, dim, temperature, device, dtype), build)


def checkpoint_target_of(module: BaseModule) -> CheckpointTarget:
    """An encoder's target: its type name is its checkpoint family."""
    name = type(module).__name__
    return CheckpointTarget(name, name, {k: v.shape for k, v in module.state_dict().items()})


def init_from_checkpoint(module: BaseModule) -> None:
    """Load ``module``'s Pretrained ``init_cfg`` through the plugged-in loader (converted for
    its ``checkpoint_target()``), or run mmengine's init."""
    if pretrained_init_cfg(module.init_cfg) is None or \
            not checkpoint_loader().load_init(module, ()):
        BaseModule.init_weights(module)


class AIFILayer(nn.Module):
    """One post-norm transformer encoder layer: self-attention with the positions added to
    queries and keys (not values), then a two-layer MLP; LayerNorm after each residual
    (before each branch with ``normalize_before``)."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, act: str, dropout: float,
                 normalize_before: bool) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'hidden_dim={dim} must be divisible by num_heads={num_heads}')
        self.num_heads, self.dropout, self.normalize_before = num_heads, dropout, normalize_before
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.act = make_activation(act)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.norm2 = nn.LayerNorm(dim)

    def _heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)  # (B, h, N, d)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        """``x (B, N, C)``, ``pos (1, N, C)`` -> ``(B, N, C)``."""
        p = self.dropout if self.training else 0.0
        y = self.norm1(x) if self.normalize_before else x
        qk = y + pos
        attn = F.scaled_dot_product_attention(
            self._heads(self.q_proj(qk)), self._heads(self.k_proj(qk)),
            self._heads(self.v_proj(y)), dropout_p=p)                # (B, h, N, d)
        attn = attn.transpose(1, 2).reshape(x.shape)                 # (B, N, C)
        x = x + F.dropout(self.out_proj(attn), p, self.training)
        if not self.normalize_before:
            x = self.norm1(x)
        y = self.norm2(x) if self.normalize_before else x
        y = self.fc2(F.dropout(self.act(self.fc1(y)), p, self.training))
        x = x + F.dropout(y, p, self.training)
        return x if self.normalize_before else self.norm2(x)


@MODELS.register_module()
class HybridEncoder(BaseModule):
    """RT-DETR's hybrid encoder in D-FINE's and DEIMv2's forms (module docstring).

    Args:
        in_channels: channels of each input level (finest first).
        in_strides: stride of each input level.
        hidden_dim: width of the encoder and of every output.
        num_heads, ffn_dim, enc_act, dropout, normalize_before: the AIFI layers.
        encoder_levels: the input levels (indices) that go through AIFI (the coarsest).
        num_encoder_layers: AIFI layers per encoded level (0: none).
        pe_temperature: temperature of the sine-cosine positions.
        expansion: branch width of the fusion blocks, ``round(expansion * hidden_dim // 2)``.
        depth_mult: RepVGG blocks per CSP layer, ``round(3 * depth_mult)``.
        act: activation of the fusion blocks.
        fuse_op: ``'cat'`` (D-FINE) or ``'sum'`` (DEIMv2) fusion of two levels.
        version: ``'dfine'`` (RepNCSPELAN4) or ``'deim'`` (RepNCSPELAN5) fusion blocks.
        csp_type: the fusion blocks' CSP layers, ``'csp'`` (D-FINE) or ``'csp2'`` (DEIMv2).
        input_proj: a 1x1 conv + BatchNorm per level to ``hidden_dim`` (False: the inputs
            already have ``hidden_dim`` channels, as DEIMv2's DINOv3 adapter gives).
        init_cfg: mmengine init config.

    Attributes:
        out_channels, out_strides: per output level (one per input level).
    """

    def __init__(self,
                 in_channels: Sequence[int] = (512, 1024, 2048),
                 in_strides: Sequence[int] = (8, 16, 32),
                 hidden_dim: int = 256,
                 num_heads: int = 8,
                 ffn_dim: int = 1024,
                 dropout: float = 0.0,
                 enc_act: str = 'gelu',
                 normalize_before: bool = False,
                 encoder_levels: Sequence[int] = (2,),
                 num_encoder_layers: int = 1,
                 pe_temperature: float = 10000.0,
                 expansion: float = 1.0,
                 depth_mult: float = 1.0,
                 act: str = 'silu',
                 fuse_op: str = 'cat',
                 version: str = 'dfine',
                 csp_type: str = 'csp',
                 input_proj: bool = True,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        chans, strides = int_tuple(in_channels, 'in_channels'), int_tuple(in_strides, 'in_strides')
        if not chans or len(chans) != len(strides):
            raise ValueError(f'in_channels={chans} and in_strides={strides} need one entry per '
                             'input level each')
        if any(b != 2 * a for a, b in zip(strides, strides[1:])):
            raise ValueError(f'in_strides={strides} must double from level to level (the '
                             'pyramid resamples by 2)')
        dim = positive_int(hidden_dim, 'hidden_dim')
        if dim % 4:
            raise ValueError(f'hidden_dim={dim} must be divisible by 4 (2D sine-cosine '
                             'positions)')
        levels = int_tuple(encoder_levels, 'encoder_levels')
        if not all(0 <= i < len(chans) for i in levels):
            raise ValueError(f'encoder_levels={levels} must index the {len(chans)} input levels')
        if fuse_op not in FUSE_OPS:
            raise ValueError(f'fuse_op={fuse_op!r} is not one of {list(FUSE_OPS)} '
                             "('cat': D-FINE, 'sum': DEIMv2)")
        if version not in VERSIONS:
            raise ValueError(f'version={version!r} is not one of {list(VERSIONS)} '
                             "('dfine': RepNCSPELAN4, 'deim': RepNCSPELAN5)")
        check_flags(normalize_before=normalize_before, input_proj=input_proj)
        check_rate(dropout, 'dropout')
        if not input_proj and any(c != dim for c in chans):
            raise ValueError(f'input_proj=False needs inputs of hidden_dim={dim} channels, got '
                             f'in_channels={chans}: give input_proj=True')
        self.in_channels, self.hidden_dim, self.fuse_op = chans, dim, fuse_op
        self.encoder_levels, self.pe_temperature = levels, float(pe_temperature)
        self.num_encoder_layers = int(num_encoder_layers)
        self.out_channels, self.out_strides = (dim,) * len(chans), strides

        self.input_proj = (nn.ModuleList(ConvNorm(c, dim) for c in chans) if input_proj
                           else None)
        self.aifi = nn.ModuleList(
            nn.ModuleList(AIFILayer(dim, num_heads, ffn_dim, enc_act, dropout,
                                    normalize_before) for _ in range(num_encoder_layers))
            for _ in levels)
        fused = 2 * dim if fuse_op == 'cat' else dim
        blocks = round(BASE_DEPTH * depth_mult)
        branch = round(expansion * dim // 2)

        def fusion_block() -> RepNCSPELAN:
            return RepNCSPELAN(fused, dim, 2 * dim, branch, blocks, act, csp_type,
                               VERSIONS[version])

        n = len(chans) - 1
        self.lateral_convs = nn.ModuleList(ConvNorm(dim, dim) for _ in range(n))
        self.fpn_blocks = nn.ModuleList(fusion_block() for _ in range(n))
        self.downsample_convs = nn.ModuleList(SCDown(dim) for _ in range(n))
        self.pan_blocks = nn.ModuleList(fusion_block() for _ in range(n))

    def checkpoint_target(self) -> CheckpointTarget:
        """What the checkpoint loader converts a D-FINE / DEIMv2 checkpoint's encoder for."""
        return checkpoint_target_of(self)

    def init_weights(self) -> None:
        """Load the ``init_cfg`` checkpoint's encoder (a transformers D-FINE / DEIMv2 folder,
        strict), or keep PyTorch's default initialisation."""
        init_from_checkpoint(self)

    def _fuse(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b if self.fuse_op == 'sum' else torch.cat([a, b], dim=1)

    def _encode(self, x: Tensor, layers: nn.Module) -> Tensor:
        """AIFI over one ``(B, C, H, W)`` level."""
        b, c, h, w = x.shape
        pos = sincos_pos_embed((h, w), c, self.pe_temperature, x.device, x.dtype)  # (1, HW, C)
        tokens = x.flatten(2).transpose(1, 2)                        # (B, H * W, C)
        for layer in layers.children():
            tokens = layer(tokens, pos)
        return tokens.transpose(1, 2).reshape(b, c, h, w).contiguous()

    def forward(self, feats: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """One ``(B, C_i, H_i, W_i)`` map per input level -> ``(B, hidden_dim, H_i, W_i)``
        per level."""
        if len(feats) != len(self.in_channels):
            raise ValueError(f'HybridEncoder was built for {len(self.in_channels)} levels '
                             f'(in_channels={self.in_channels}), got {len(feats)} maps')
        maps: List[Tensor] = (list(feats) if self.input_proj is None
                              else [proj(f) for proj, f in zip(self.input_proj, feats)])
        if self.num_encoder_layers:
            for level, layers in zip(self.encoder_levels, self.aifi):
                maps[level] = self._encode(maps[level], layers)
        # top-down: the coarsest map, laterally projected, upsampled into each finer level
        inner = [maps[-1]]
        for i, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            top = lateral(inner[0])
            inner[0] = top
            up = F.interpolate(top, scale_factor=2.0, mode='nearest')
            inner.insert(0, block(self._fuse(up, maps[-2 - i])))
        # bottom-up: each output downsampled into the next coarser level
        outs = [inner[0]]
        for i, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            outs.append(block(self._fuse(down(outs[-1]), inner[i + 1])))
        return tuple(outs)
