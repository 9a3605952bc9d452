"""Building blocks of the D-FINE / DEIMv2 decoder: Fine-grained Distribution Refinement.

D-FINE predicts each box edge as a distribution over ``reg_max + 1`` bins. The bins' values are
the non-uniform weighting function ``W(n)`` (:func:`weighting_function`): fine steps near the
reference edge, coarse ones far from it, ``+-2 up reg_scale`` at the ends. The expected value
``sum_n softmax(logits)_n W(n)`` (:func:`integral`) is an edge offset in units of the reference
box size over ``reg_scale``; :func:`distance_to_box` turns the four offsets into a box.

- :class:`DFineDeformableAttention`: multi-scale deformable cross-attention with a point count
  per level, offsets scaled by the reference box size over the level's point count, and no
  value / output projections.
- :class:`QualityEstimator` (LQE): adds a score from the top-k bin probabilities of the four
  edge distributions to the class logits.
- :class:`DFineDecoderLayer`: self-attention, gated deformable cross-attention and an FFN, in
  D-FINE's form (LayerNorm, ReLU MLP) or DEIMv2's (RMSNorm, SwiGLU, optional gate).
"""
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.cross_attention import MultiheadCrossAttention
from ..layers.mlp import Mlp
from ..layers.swiglu import SwiGLU

#: the float16 range: D-FINE clamps the FFN residual to it before the last norm.
FP16_MAX = 65504.0
#: DEIMv2's RMSNorm epsilon.
RMS_NORM_EPS = 1e-6
#: decoder layer styles: D-FINE (LayerNorm, MLP FFN) and DEIMv2 (RMSNorm, SwiGLU FFN).
STYLES = ('dfine', 'deimv2')
#: deformable sampling: bilinear with zero padding, or the nearest pixel clamped to the map.
SAMPLINGS = ('bilinear', 'discrete')
#: activations the D-FINE MLPs may use, by config name.
ACTIVATIONS = {'relu': nn.ReLU, 'gelu': nn.GELU, 'silu': nn.SiLU}


def weighting_function(reg_max: int, up: float, reg_scale: float) -> Tensor:
    """``W(n)`` for ``n = 0 .. reg_max``: ``(reg_max + 1,)`` bin values, 0 in the middle.

    Inner bins grow geometrically (``+-(step^i - 1)``, ``step = (up reg_scale + 1) ^
    (2 / (reg_max - 2))``) up to ``+-up reg_scale``; the two outer bins are ``+-2 up reg_scale``.
    """
    bound = abs(up) * abs(reg_scale)
    step = (bound + 1) ** (2 / (reg_max - 2))
    half = reg_max // 2
    right = [step ** i - 1 for i in range(1, half)]
    left = [-v for v in reversed(right)]
    return torch.tensor([-2 * bound] + left + [0.0] + right + [2 * bound], dtype=torch.float32)


def integral(corners: Tensor, project: Tensor) -> Tensor:
    """Expected edge offsets: ``(..., 4 (reg_max + 1))`` bin logits -> ``(..., 4)``."""
    probs = corners.unflatten(-1, (4, project.numel())).softmax(-1)   # (..., 4, reg_max + 1)
    return probs @ project.to(probs.dtype)


def distance_to_box(ref: Tensor, distance: Tensor, reg_scale: float) -> Tensor:
    """Reference ``(..., 4)`` cxcywh boxes + edge offsets ``(..., 4)`` (left, top, right, bottom,
    in units of the reference size / ``reg_scale``, 0 = the reference's edge) -> cxcywh boxes."""
    reg_scale = abs(reg_scale)
    size = torch.cat([ref[..., 2:], ref[..., 2:]], dim=-1)             # (..., 4) w h w h
    edges = (0.5 * reg_scale + distance) * size / reg_scale              # (..., 4)
    x0y0 = ref[..., :2] - edges[..., :2]
    x1y1 = ref[..., :2] + edges[..., 2:]
    return torch.cat([(x0y0 + x1y1) / 2, x1y1 - x0y0], dim=-1)


class MLP(nn.Module):
    """``num_layers`` linear layers with an activation between them (``layers.<i>``)."""

    def __init__(self, in_dims: int, hidden_dims: int, out_dims: int, num_layers: int,
                 act: str = 'relu') -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f'act={act!r} is not one of {sorted(ACTIVATIONS)}; pick one of them')
        dims = [in_dims] + [hidden_dims] * (num_layers - 1) + [out_dims]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:]))
        self.act = ACTIVATIONS[act]()

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else self.act(layer(x))
        return x


class QualityEstimator(nn.Module):
    """LQE: ``logits + MLP([top-k probs, their mean] of the 4 edge distributions)``."""

    def __init__(self, reg_max: int, top_k: int = 4, hidden_dims: int = 64,
                 num_layers: int = 2, act: str = 'relu') -> None:
        super().__init__()
        self.reg_max = reg_max
        self.top_k = top_k
        self.reg_conf = MLP(4 * (top_k + 1), hidden_dims, 1, num_layers, act)

    def forward(self, logits: Tensor, corners: Tensor) -> Tensor:
        probs = corners.unflatten(-1, (4, self.reg_max + 1)).softmax(-1)  # (B, Q, 4, R + 1)
        top = probs.topk(self.top_k, dim=-1).values                       # (B, Q, 4, k)
        stat = torch.cat([top, top.mean(-1, keepdim=True)], dim=-1)       # (B, Q, 4, k + 1)
        return logits + self.reg_conf(stat.flatten(-2))


class DFineDeformableAttention(nn.Module):
    """Deformable cross-attention over a multi-level memory, ``num_points[l]`` points per head
    on level ``l``.

    A query with reference box ``(cx, cy, w, h)`` samples level ``l`` at ``(cx, cy) + offset /
    num_points[l] * (w, h) * offset_scale`` and sums the samples with softmax weights taken over
    all its points of all levels. ``sampling='bilinear'``: bilinear, zeros outside the map;
    ``'discrete'``: the pixel at ``trunc(loc * size + 0.5)`` clamped to the map (D-FINE's
    deployment variant). The memory is used as the values directly (no value or output
    projection).
    """

    num_points_scale: Tensor

    def __init__(self, embed_dims: int, num_heads: int, num_points: Sequence[int],
                 offset_scale: float = 0.5, sampling: str = 'bilinear') -> None:
        super().__init__()
        if sampling not in SAMPLINGS:
            raise ValueError(f'sampling={sampling!r} is not one of {SAMPLINGS}; D-FINE\'s '
                             "decoder_method 'default' is bilinear")
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims={embed_dims} must be divisible by num_heads='
                             f'{num_heads}; choose a head count that divides it')
        self.num_heads = num_heads
        self.num_points = [int(p) for p in num_points]
        self.offset_scale = offset_scale
        self.sampling = sampling
        total = sum(self.num_points)
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * total * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * total)
        scale = [1.0 / p for p in self.num_points for _ in range(p)]
        self.register_buffer('num_points_scale', torch.tensor(scale), persistent=False)

    def forward(self, query: Tensor, ref: Tensor, memory: Tensor,
                spatial_shapes: Sequence[Tuple[int, int]]) -> Tensor:
        """``query (B, Q, C)``, ``ref (B, Q, 4)`` cxcywh in [0, 1], ``memory (B, S, C)`` (levels
        flattened row-major, ``S = sum h w``) -> ``(B, Q, C)``."""
        bs, nq, _ = query.shape
        heads, total = self.num_heads, sum(self.num_points)
        offsets = self.sampling_offsets(query).view(bs, nq, heads, total, 2)
        weights = self.attention_weights(query).view(bs, nq, heads, total).softmax(-1)
        scale = self.num_points_scale.to(query.dtype)[:, None]           # (P, 1)
        loc = ref[:, :, None, None, :2] + (
            offsets * scale * ref[:, :, None, None, 2:] * self.offset_scale)  # (B, Q, H, P, 2)
        loc = loc.transpose(1, 2).flatten(0, 1)                          # (B H, Q, P, 2)
        values = memory.unflatten(-1, (heads, -1)).permute(0, 2, 3, 1).flatten(0, 1)
        values = values.split([h * w for h, w in spatial_shapes], dim=-1)  # (B H, d, h w) each
        samples: List[Tensor] = []
        for value, level_loc, (h, w) in zip(values, loc.split(self.num_points, dim=2),
                                            spatial_shapes):
            samples.append(self._sample(value, level_loc, h, w))       # (B H, d, Q, P_l)
        sampled = torch.cat(samples, dim=-1)                             # (B H, d, Q, P)
        weights = weights.transpose(1, 2).flatten(0, 1)[:, None]         # (B H, 1, Q, P)
        out = (sampled * weights).sum(-1).view(bs, -1, nq)               # (B, C, Q)
        return out.transpose(1, 2)

    def _sample(self, value: Tensor, loc: Tensor, h: int, w: int) -> Tensor:
        """``value (N, d, h w)`` at ``loc (N, Q, P, 2)`` in [0, 1] -> ``(N, d, Q, P)``."""
        if self.sampling == 'bilinear':
            return F.grid_sample(value.unflatten(-1, (h, w)), 2 * loc - 1, mode='bilinear',
                                 padding_mode='zeros', align_corners=False)
        size = loc.new_tensor([w, h])
        pixel = (loc * size + 0.5).long()                                # (N, Q, P, 2) x, y
        x, y = pixel[..., 0].clamp(0, w - 1), pixel[..., 1].clamp(0, h - 1)
        index = (y * w + x).flatten(1)                                   # (N, Q P)
        picked = value.gather(-1, index[:, None].expand(-1, value.shape[1], -1))
        return picked.unflatten(-1, loc.shape[1:3])


class Gate(nn.Module):
    """``norm(g1 * residual + g2 * x)`` with ``[g1, g2] = sigmoid(Linear([residual, x]))``."""

    def __init__(self, embed_dims: int, norm: nn.Module) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * embed_dims, 2 * embed_dims)
        self.norm = norm

    def forward(self, residual: Tensor, x: Tensor) -> Tensor:
        g1, g2 = torch.sigmoid(self.gate(torch.cat([residual, x], dim=-1))).chunk(2, dim=-1)
        return self.norm(g1 * residual + g2 * x)


class DFineDecoderLayer(nn.Module):
    """Post-norm decoder layer: self-attention (position added to queries and keys), deformable
    cross-attention merged by a :class:`Gate` (or residual + norm without one), FFN.

    Args:
        style: ``'dfine'`` (LayerNorm, ``Mlp`` FFN with ``ffn_act``, FFN output clamped to the
            float16 range) or ``'deimv2'`` (RMSNorm, SwiGLU FFN with ``ffn_dims // 2`` hidden).
        use_gateway: the gate after cross-attention (D-FINE always has it).
        sampling: :class:`DFineDeformableAttention`'s.
    """

    def __init__(self, embed_dims: int, num_heads: int, ffn_dims: int, num_points: Sequence[int],
                 offset_scale: float = 0.5, style: str = 'dfine', use_gateway: bool = True,
                 ffn_act: str = 'relu', layer_norm_eps: float = 1e-5,
                 dropout: float = 0.0, attn_drop: float = 0.0,
                 sampling: str = 'bilinear') -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f'style={style!r} is not one of {STYLES}; use dfine for D-FINE and '
                             'deimv2 for DEIMv2')
        if style == 'dfine' and not use_gateway:
            raise ValueError("use_gateway=False exists only in DEIMv2's layer; set "
                             "style='deimv2' or use_gateway=True")
        self.style = style

        def norm() -> nn.Module:
            if style == 'dfine':
                return nn.LayerNorm(embed_dims, eps=layer_norm_eps)
            return nn.RMSNorm(embed_dims, eps=RMS_NORM_EPS)

        self.self_attn = MultiheadCrossAttention(embed_dims, num_heads, attn_drop=attn_drop)
        self.norm1 = norm()
        self.cross_attn = DFineDeformableAttention(embed_dims, num_heads, num_points,
                                                   offset_scale, sampling)
        self.gateway = Gate(embed_dims, norm()) if use_gateway else None
        self.norm2 = None if use_gateway else norm()
        self.ffn: nn.Module = (Mlp(embed_dims, ffn_dims, act_layer=ACTIVATIONS[ffn_act])
                               if style == 'dfine' else SwiGLU(embed_dims, ffn_dims // 2))
        self.norm3 = norm()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor, pos: Tensor, ref: Tensor, memory: Tensor,
                spatial_shapes: Sequence[Tuple[int, int]], attn_mask: Tensor | None = None
                ) -> Tensor:
        """``x, pos (B, Q, C)``, ``ref (B, Q, 4)``, ``memory (B, S, C)``, ``attn_mask``
        additive ``(Q, Q)`` (denoising groups) -> ``(B, Q, C)``."""
        qk = x + pos
        x = self.norm1(x + self.dropout(self.self_attn(qk, qk, x, attn_mask)))
        cross = self.dropout(self.cross_attn(x + pos, ref, memory, spatial_shapes))
        if self.gateway is not None:
            x = self.gateway(x, cross)
        else:
            assert self.norm2 is not None
            x = self.norm2(x + cross)
        x = x + self.ffn(x)
        if self.style == 'dfine':
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return self.norm3(x)
