"""The official checkpoint layouts of DINOv2, DINOv3 and EVA-02 -> timm's layout of the family.

Pure ``state_dict -> state_dict`` functions. timm's layout is the interchange format: DINOv2
becomes timm ``VisionTransformer`` names (``vit_*_patch14[_reg4]_dinov2``), DINOv3 and EVA-02
become timm ``Eva`` names (``vit_*_patch16_dinov3[_qkvb]``, ``eva02_*_patch14_*``); another
converter takes timm's layout to ours. The key maps are written from the reference model code
(cited at each map); :data:`OFFICIAL_VIT_LAYOUTS` names the layouts:

* ``dinov2``: facebookresearch/dinov2 ``dinov2_vit{s,b,l,g}14[_reg4]_pretrain.pth`` (and
  training checkpoints with ``block_chunks`` nesting, ``blocks.{chunk}.{i}``);
* ``dinov3``: facebookresearch/dinov3 ``dinov3_vit{s,s+,b,l,h+}16_pretrain_*.pth``;
* ``eva02``: baaivision/EVA EVA-02 MIM checkpoints ``eva02_{Ti,S,B,L}_pt_*_p14.pt`` and their
  fine-tuned ``eva02_*_p14*.pt`` (and EVA-02-CLIP's vision tower names, ``inner_attn_ln``);
* ``eva02_det``: the ViT of EVA-02's ViTDet detectors (EVA-02/det, detectron2
  ``backbone.net.*``; the pyramid ``backbone.simfp_*`` and the heads are dropped). Its ViT has
  no cls token (``pos_embed`` keeps the pretraining cls slot), so the converted dict has no
  ``cls_token``; its per-block rope tables are window-local (``rope_win``) or global
  (``rope_glb``), see :func:`eva02_det_window_blocks`.

Buffers the timm layout has no place for are checked, then dropped: DINOv3's rope periods
must be the ones its rope base gives, its k-bias mask must mask exactly the k third; EVA-02's
rope tables must be its ``VisionRotaryEmbeddingFast`` tables. A checkpoint that fails a check
is refused with a :class:`CheckpointError` naming the key and the fix.
"""
import math
import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .checkpoint_io import CheckpointError
from .common import StateDict, is_square_grid, unwrap_state_dict

OFFICIAL_VIT_LAYOUTS = ('dinov2', 'dinov3', 'eva02', 'eva02_det')
#: The family of each official layout.
OFFICIAL_FAMILIES = {'dinov2': 'DINOv2', 'dinov3': 'DINOv3', 'eva02': 'EVA-02',
                     'eva02_det': 'EVA-02'}
#: Where EVA-02's detectron2 detectors (EVA-02/det) keep their ViT.
EVA02_DET_PREFIX = 'backbone.net.'

#: DINOv3's rope base (``pos_embed_rope_base`` of every hub ViT in dinov3/hub/backbones.py;
#: timm's ``rope_temperature`` of its dinov3 models).
DINOV3_ROPE_BASE = 100.0
#: EVA-02's rope theta (``VisionRotaryEmbeddingFast(theta=10000)``, EVA-02/asuka/rope.py).
EVA02_ROPE_THETA = 10000.0
#: How far a stored rope table (cos / sin values in [-1, 1]) may be from the one rebuilt here:
#: float32 rounding of angles up to a few hundred radians, not a different setting.
ROPE_TABLE_ATOL = 1e-4
#: Relative tolerance of a stored DINOv3 period, in units of its dtype's epsilon (float32 or
#: bfloat16 rounding of the same power).
PERIOD_RTOL_EPS = 4

_CHUNKED_BLOCK = re.compile(r'^blocks\.\d+\.(\d+)\.')
_DINOV2_SWIGLU = re.compile(r'^(blocks\.\d+\.mlp\.)(w12|w3|w1|w2)\.(weight|bias)$')
_EVA02_BLOCK = re.compile(r'^blocks\.\d+\.(attn\.(q_bias|v_bias|inner_attn_ln\.)|'
                          r'mlp\.(w1|w2|w3|w12|ffn_ln)\.)')
_EVA02_ROPE = re.compile(r'(^|\.)rope(_win|_glb)?\.freqs_(cos|sin)$')


def _layouts_hint() -> str:
    return f'one of {OFFICIAL_VIT_LAYOUTS}'


# ----------------------------------------------------------------------------- detection
def detect_official_vit_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """Which official layout ``sd`` is in (one of :data:`OFFICIAL_VIT_LAYOUTS`), or None when
    it is none of them (e.g. timm's own layout of these families, or another ViT).

    ``sd`` is a tensor dict; wrappers (``model`` / ``module`` / ``state_dict``, a ``module.``
    prefix) are removed first by :func:`~.common.unwrap_state_dict`.
    """
    sd = unwrap_state_dict(sd)
    mask = sd.get('mask_token')
    # dinov3/models/vision_transformer.py DinoVisionTransformer: storage tokens, a persistent
    # rope_embed.periods buffer, LinearKMaskedBias's qkv.bias_mask
    if ('storage_tokens' in sd or 'rope_embed.periods' in sd
            or any(k.endswith('.attn.qkv.bias_mask') for k in sd)):
        return 'dinov3'
    # dinov2/models/vision_transformer.py DinoVisionTransformer: register_tokens, a (1, C)
    # mask_token, BlockChunk nesting, SwiGLUFFNFused's w12 / w3 next to a fused qkv
    fused_qkv = any(k.endswith('.attn.qkv.weight') for k in sd)
    if fused_qkv and ('register_tokens' in sd
                      or (mask is not None and mask.dim() == 2 and 'pos_embed' in sd)
                      or any(_CHUNKED_BLOCK.match(k) for k in sd)
                      or any(_DINOV2_SWIGLU.match(k) for k in sd)) \
            and not any(k.endswith('.attn.q_bias') for k in sd):
        return 'dinov2'
    # EVA-02/det detectron2/modeling/backbone/vit.py ViT: backbone.net.*, rope_win / rope_glb
    net = {k[len(EVA02_DET_PREFIX):]: v for k, v in sd.items() if k.startswith(EVA02_DET_PREFIX)}
    if net and ('rope_win.freqs_cos' in net or 'rope_glb.freqs_cos' in net
                or any(_EVA02_BLOCK.match(k) for k in net)):
        return 'eva02_det'
    # EVA-02/asuka modeling_pretrain / modeling_finetune: q_bias / v_bias, mlp.w1 w2 w3 (or
    # xformers' packed w12), ffn_ln, inner_attn_ln (EVA-02-CLIP), rope freqs buffers, lm_head
    if any(_EVA02_BLOCK.match(k) for k in sd) and (
            any(_EVA02_ROPE.search(k) for k in sd) or any('.mlp.w' in k for k in sd)
            or any('inner_attn_ln' in k or 'ffn_ln' in k for k in sd)):
        return 'eva02'
    return None


# ----------------------------------------------------------------------------- DINOv2
def _dinov2_block_key(key: str) -> str:
    """``blocks.{chunk}.{i}.rest`` (BlockChunk nesting, ``block_chunks > 0``: each chunk keeps
    the global block index after ``nn.Identity`` placeholders) -> ``blocks.{i}.rest``."""
    m = _CHUNKED_BLOCK.match(key)
    return f'blocks.{m.group(1)}.{key[m.end():]}' if m else key


def _dinov2_to_timm(sd: StateDict) -> Tuple[StateDict, List[str]]:
    """dinov2/models/vision_transformer.py ``DinoVisionTransformer`` -> timm
    ``VisionTransformer`` (timm's ``_convert_dinov2`` produces the same names)."""
    out: StateDict = {}
    dropped: List[str] = []
    halves: Dict[str, Dict[str, Tensor]] = {}
    for key, v in sd.items():
        if key == 'mask_token':  # iBOT masking, pretraining only
            dropped.append(key)
            continue
        k = _dinov2_block_key(key)
        if k in out or k in halves:
            raise CheckpointError(f'dinov2 checkpoint: {key!r} and another key are both block '
                                  f'{k!r} (block_chunks nesting gives each block once); the '
                                  'file mixes two models: save it again from one model')
        m = _DINOV2_SWIGLU.match(k)
        if m is None:
            out[k] = v
        elif m.group(2) == 'w12':  # SwiGLUFFNFused (xformers SwiGLU packed): silu(x1) * x2
            out[f'{m.group(1)}fc1.{m.group(3)}'] = v  # timm SwiGLUPacked: gate first, as here
        elif m.group(2) == 'w3':
            out[f'{m.group(1)}fc2.{m.group(3)}'] = v
        else:  # SwiGLUFFNAligned / unpacked xformers SwiGLU: w1 (gate), w2 -> packed fc1
            halves.setdefault(f'{m.group(1)}fc1.{m.group(3)}', {})[m.group(2)] = v
    for k, parts in halves.items():
        if set(parts) != {'w1', 'w2'}:
            raise CheckpointError(f'dinov2 checkpoint: {k.replace("fc1", "w1|w2")} has only '
                                  f'{sorted(parts)}; a SwiGLU needs both w1 and w2: the file is '
                                  'incomplete, save it again')
        out[k] = torch.cat([parts['w1'], parts['w2']], dim=0)
    if 'register_tokens' in out:
        # timm's *_reg4_dinov2 models are no_embed_class: the cls slot of the position
        # embedding (added to the cls token only, prepare_tokens_with_masks) moves into it
        pos = out.pop('pos_embed', None)
        if pos is None or pos.dim() != 3 or not is_square_grid(pos.shape[1] - 1):
            shape = None if pos is None else tuple(pos.shape)
            raise CheckpointError(f'dinov2 checkpoint with register_tokens: pos_embed {shape} '
                                  'is not (1, 1 + gh * gw, C) with a square grid; the file is '
                                  'not a DINOv2 checkpoint, or incomplete')
        out['reg_token'] = out.pop('register_tokens')
        out['cls_token'] = out['cls_token'] + pos[:, :1]
        out['pos_embed'] = pos[:, 1:]
    return out, dropped


# ----------------------------------------------------------------------------- DINOv3
def dinov3_periods(head_dim: int, base: float = DINOV3_ROPE_BASE) -> Tensor:
    """The rope periods ``RopePositionEmbedding._init_weights`` gives for ``base``
    (dinov3/layers/rope_position_encoding.py), float64: ``base ** (2 i / (head_dim / 2))``."""
    i = torch.arange(head_dim // 4, dtype=torch.float64)
    return base ** (2 * i / (head_dim // 2))


def _check_dinov3_periods(key: str, periods: Tensor, base: float) -> None:
    expected = dinov3_periods(4 * periods.numel(), base).to(periods.dtype)
    rtol = PERIOD_RTOL_EPS * torch.finfo(periods.dtype).eps
    if periods.dim() != 1 or not torch.allclose(periods.double(), expected.double(), rtol=rtol,
                                                atol=0.0):
        raise CheckpointError(
            f'dinov3 checkpoint: {key!r} {_head(periods)} are not the rope periods of base '
            f'{base:g} (base ** (2 i / (head_dim / 2)), head_dim {4 * periods.numel()}: '
            f'{_head(expected)}); timm\'s dinov3 layout computes them from the base. Pass '
            'rope_base=<the pos_embed_rope_base it was trained with>; a checkpoint trained with '
            'pos_embed_rope_min_period / max_period has no timm layout')


def _head(t: Tensor, n: int = 3) -> str:
    vals = ', '.join(f'{x:.6g}' for x in t.flatten()[:n].tolist())
    return f'[{vals}{", ..." if t.numel() > n else ""}]'


def _split_dinov3_qkv_bias(key: str, bias: Tensor, mask: Optional[Tensor],
                           qkv_bias: Optional[bool]) -> Optional[Tuple[Tensor, Tensor]]:
    """q and v thirds of ``LinearKMaskedBias``'s bias (dinov3/layers/attention.py): its k third
    is multiplied by ``bias_mask`` (zeros there, ones elsewhere) and so never used."""
    dim = bias.shape[0] // 3
    q, k, v = bias.split(dim)
    if mask is not None:
        want = torch.ones_like(mask)
        want[dim:2 * dim] = 0
        if not torch.equal(mask, want):  # NaN (never initialised) fails too
            raise CheckpointError(
                f'dinov3 checkpoint: {key}_mask {_head(mask[dim - 1:dim + 2])} around the q/k '
                f'boundary is not the k-bias mask of LinearKMaskedBias (ones on the q and v '
                f'thirds, zeros on the k third of {3 * dim}); timm\'s layout has no k bias. '
                'Convert a checkpoint saved from a model built with mask_k_bias=True (every '
                'DINOv3 hub ViT), whose mask init_weights() has filled')
    elif torch.count_nonzero(k):
        raise CheckpointError(
            f'dinov3 checkpoint: {key} has a non-zero k third and no bias_mask (a model built '
            'with mask_k_bias=False): the k bias moves with rope and timm\'s dinov3 layout has '
            'none. Convert a checkpoint trained with mask_k_bias=True (every DINOv3 hub ViT)')
    if qkv_bias is False:
        if torch.count_nonzero(q) or torch.count_nonzero(v):
            raise CheckpointError(
                f'dinov3 checkpoint: {key} has non-zero q / v biases, which a model without '
                'qkv bias would lose: build DINOv3Backbone with q / v biases (arch=dict(..., '
                "qkv_bias='qv')); for timm, convert with qkv_bias=None or True and use the "
                '*_qkvb model')
        return None
    return q, v


def _dinov3_to_timm(sd: StateDict, rope_base: float,
                    qkv_bias: Optional[bool]) -> Tuple[StateDict, List[str]]:
    """dinov3/models/vision_transformer.py ``DinoVisionTransformer`` (SelfAttentionBlock:
    ls1 / ls2 LayerScale, LinearKMaskedBias qkv, Mlp fc1 / fc2 or SwiGLUFFN w1 / w2 / w3) ->
    timm ``Eva`` (``gamma_1`` / ``gamma_2``, ``attn.q_bias`` / ``v_bias``, ``mlp.fc1_g`` /
    ``fc1_x`` / ``fc2``, ``reg_token``)."""
    out: StateDict = {}
    dropped: List[str] = []
    has_bias = any(k.endswith('.attn.qkv.bias') for k in sd)
    if qkv_bias and not has_bias:
        raise CheckpointError('dinov3 checkpoint: qkv_bias=True asks for q / v biases, but no '
                              "'blocks.N.attn.qkv.bias' is in it (a model built with "
                              'qkv_bias=False); convert with qkv_bias=None or False')
    for k, v in sd.items():
        if k == 'rope_embed.periods':
            _check_dinov3_periods(k, v, rope_base)
            dropped.append(k)
        elif k == 'mask_token' or k.endswith('.attn.qkv.bias_mask'):
            dropped.append(k)  # iBOT masking; the mask is checked with its bias below
        elif k.startswith(('cls_norm.', 'local_cls_norm.')):
            # untied norms of the cls / storage tokens (local crops: pretraining only); the
            # patch tokens' final norm is ``norm``, which timm keeps
            dropped.append(k)
        elif k.endswith('.attn.qkv.bias'):
            split = _split_dinov3_qkv_bias(k, v, sd.get(k + '_mask'), qkv_bias)
            if split is None:
                dropped.append(k)
            else:
                out[k.replace('qkv.bias', 'q_bias')], out[k.replace('qkv.bias', 'v_bias')] = split
        else:
            out[_dinov3_name(k)] = v
    return out, dropped


_DINOV3_RENAMES = ((re.compile(r'\.ls([12])\.gamma$'), r'.gamma_\1'),
                   (re.compile(r'\.mlp\.w1\.'), '.mlp.fc1_g.'),
                   (re.compile(r'\.mlp\.w2\.'), '.mlp.fc1_x.'),
                   (re.compile(r'\.mlp\.w3\.'), '.mlp.fc2.'),
                   (re.compile(r'^storage_tokens$'), 'reg_token'))


def _dinov3_name(key: str) -> str:
    for pattern, repl in _DINOV3_RENAMES:
        key = pattern.sub(repl, key)
    return key


# ----------------------------------------------------------------------------- EVA-02
def eva02_rope_table(grid: int, ref_grid: float, head_dim: int,
                     theta: float = EVA02_ROPE_THETA) -> Tuple[Tensor, Tensor]:
    """``(freqs_cos, freqs_sin)`` of EVA-02's ``VisionRotaryEmbeddingFast(dim=head_dim // 2,
    pt_seq_len=ref_grid, ft_seq_len=grid)`` (EVA-02/asuka/rope.py), float64, ``(grid**2,
    head_dim)``: rows are (h, w) positions, columns the h half then the w half, each frequency
    repeated twice (interleaved pairs)."""
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float64)[:half // 2] / half)
    t = torch.arange(grid, dtype=torch.float64) / grid * ref_grid
    angles = (t[:, None] * freqs[None, :]).repeat_interleave(2, dim=-1)  # (grid, half)
    table = torch.cat([angles[:, None, :].expand(grid, grid, half),
                       angles[None, :, :].expand(grid, grid, half)], dim=-1)
    table = table.reshape(grid * grid, head_dim)
    return table.cos(), table.sin()


def eva02_rope_grids(sd: Mapping[str, Tensor],
                     key: str = 'rope.freqs_cos') -> Optional[Tuple[int, float]]:
    """``(grid, ref_grid)`` of an EVA-02 rope table in ``sd`` (the fine-tuning grid
    ``ft_seq_len`` and the pretraining grid ``pt_seq_len`` it is scaled to; timm's
    ``ref_feat_shape``), read from the table; None when ``sd`` has no ``key``."""
    cos = sd.get(key)
    if cos is None:
        return None
    sin = sd.get(key[:-len('cos')] + 'sin') if key.endswith('cos') else None
    grid = math.isqrt(cos.shape[0]) if cos.dim() == 2 else 0
    if grid < 2 or grid * grid != cos.shape[0] or sin is None or sin.shape != cos.shape:
        raise CheckpointError(f'EVA-02 checkpoint: {key!r} {tuple(cos.shape)} is not a rope '
                              'table of a square grid (grid**2, head_dim) with its freqs_sin; '
                              'the file is not an EVA-02 checkpoint, or incomplete')
    # position (h=0, w=1), last column: the w half's slowest frequency f, whose angle
    # f * ref_grid / grid is far below pi for any grids (atan2 of a small angle is exact to
    # float32's relative precision)
    half = cos.shape[1] // 2
    slowest = EVA02_ROPE_THETA ** (-2 * (half // 2 - 1) / half)
    step = math.atan2(float(sin[1, -1]), float(cos[1, -1])) / slowest
    return grid, round(step * grid, 3)


def _check_eva02_rope(sd: StateDict) -> List[str]:
    """The rope buffers of ``sd`` (model-level and each block's copy of the shared module);
    each must be EVA-02's table for its grid (theta 10000), else the checkpoint is refused."""
    keys = [k for k in sd if _EVA02_ROPE.search(k)]
    for key in (k for k in keys if k.endswith('cos')):
        grids = eva02_rope_grids(sd, key)
        assert grids is not None  # key is in sd
        grid, ref = grids
        cos, sin = eva02_rope_table(grid, ref, sd[key].shape[1])
        sin_key = key[:-len('cos')] + 'sin'
        if not (torch.allclose(sd[key].double(), cos, atol=ROPE_TABLE_ATOL, rtol=0.0)
                and torch.allclose(sd[sin_key].double(), sin, atol=ROPE_TABLE_ATOL, rtol=0.0)):
            raise CheckpointError(
                f'EVA-02 checkpoint: the rope table {key!r} / {sin_key!r} is not the table of '
                f"EVA-02's VisionRotaryEmbeddingFast (theta {EVA02_ROPE_THETA:g}) for its grid "
                f'{grid} and the pretraining grid its slowest frequency gives ({ref:g}); '
                "timm's eva02 layout rebuilds rope from those settings, so this checkpoint "
                '(other rope settings) cannot be converted: use the model code it was trained '
                'with')
    if any(k.endswith('sin') and k[:-len('sin')] + 'cos' not in sd for k in keys):
        raise CheckpointError('EVA-02 checkpoint: a rope freqs_sin has no freqs_cos next to it '
                              f'({keys[:3]}); the file is incomplete, save it again')
    return keys


_EVA02_RENAMES = ((re.compile(r'\.attn\.inner_attn_ln\.'), '.attn.norm.'),
                  (re.compile(r'\.mlp\.ffn_ln\.'), '.mlp.norm.'),
                  (re.compile(r'\.mlp\.w12\.'), '.mlp.fc1.'),
                  (re.compile(r'\.mlp\.w1\.'), '.mlp.fc1_g.'),
                  (re.compile(r'\.mlp\.w2\.'), '.mlp.fc1_x.'),
                  (re.compile(r'\.mlp\.w3\.'), '.mlp.fc2.'))


def _eva02_to_timm(sd: StateDict) -> Tuple[StateDict, List[str]]:
    """EVA-02/asuka ``VisionTransformerForMaskedImageModeling`` (modeling_pretrain.py) and
    ``VisionTransformer`` (modeling_finetune.py) -> timm ``Eva``.

    Attention: fused ``qkv`` (T / S) or ``q_proj`` / ``k_proj`` / ``v_proj`` without biases
    (B / L, ``subln``), with ``q_bias`` / ``v_bias`` parameters (k has none); timm's unfused
    layout keeps them as ``q_proj.bias`` / ``v_proj.bias``. MLP: xformers' packed SwiGLU
    ``w12`` / ``w3`` (T / S) or the naive ``w1`` / ``w2`` / ``ffn_ln`` / ``w3`` (B / L). The
    MIM head (``lm_head``), ``mask_token`` and the rope buffers are dropped; the pretraining
    model's final ``norm`` becomes ``fc_norm``, where timm's eva02 models (average pooling)
    keep it, as fine-tuned checkpoints already have it.
    """
    rope = set(_check_eva02_rope(sd))
    mim = 'lm_head.weight' in sd or 'mask_token' in sd
    unfused = any(k.endswith('.attn.q_proj.weight') for k in sd)
    out: StateDict = {}
    dropped: List[str] = []
    for k, v in sd.items():
        if k in rope or k == 'mask_token' or k.startswith('lm_head.'):
            dropped.append(k)
            continue
        if mim and k.startswith('norm.'):
            k = 'fc_' + k
        for pattern, repl in _EVA02_RENAMES:
            k = pattern.sub(repl, k)
        if unfused:
            k = re.sub(r'\.attn\.([qv])_bias$', r'.attn.\1_proj.bias', k)
        out[k] = v
    return out, dropped


# ----------------------------------------------------------------------------- entry point
def official_to_timm(sd: Mapping[str, Tensor], layout: str, *,
                     rope_base: float = DINOV3_ROPE_BASE,
                     qkv_bias: Optional[bool] = None) -> Tuple[StateDict, List[str]]:
    """Convert an official DINOv2 / DINOv3 / EVA-02 state dict to timm's layout of the family.

    Args:
        sd: the tensor dict (wrappers are removed by :func:`~.common.unwrap_state_dict`).
        layout: one of :data:`OFFICIAL_VIT_LAYOUTS` (see :func:`detect_official_vit_layout`).
        rope_base: DINOv3 only: the rope base the stored periods must follow.
        qkv_bias: DINOv3 only: None keeps the q / v biases when the checkpoint has them
            (timm ``vit_*_dinov3_qkvb``); False drops them, which must be all zero (timm
            ``vit_*_dinov3``, the distilled hub models); True requires them.

    Returns:
        the converted state dict and the names of the dropped source keys (mask tokens, MIM
        head, rope buffers, DINOv3's k-bias masks and untied cls norms).
    """
    if layout not in OFFICIAL_VIT_LAYOUTS:
        raise CheckpointError(f'layout={layout!r} is not an official ViT layout; give '
                              f'{_layouts_hint()}, or detect it with '
                              'detect_official_vit_layout(state_dict)')
    tensors = unwrap_state_dict(sd)
    if layout == 'dinov2':
        return _dinov2_to_timm(tensors)
    if layout == 'dinov3':
        return _dinov3_to_timm(tensors, rope_base, qkv_bias)
    if layout == 'eva02_det':
        net, others = _eva02_det_net(tensors)
        converted, dropped = _eva02_to_timm(net)
        return converted, others + [EVA02_DET_PREFIX + k for k in dropped]
    return _eva02_to_timm(tensors)


def _eva02_det_net(sd: StateDict) -> Tuple[StateDict, List[str]]:
    """The ViT of an EVA-02 detector (``backbone.net.*``, un-prefixed) and the other keys
    (the simple pyramid ``backbone.simfp_*``, RPN / ROI heads)."""
    net = {k[len(EVA02_DET_PREFIX):]: v for k, v in sd.items() if k.startswith(EVA02_DET_PREFIX)}
    if not net:
        raise CheckpointError(f'eva02_det checkpoint: no key starts with {EVA02_DET_PREFIX!r} '
                              f'(first keys: {list(sd)[:3]}); give the detector checkpoint of '
                              "EVA-02/det, or layout='eva02' for a MIM / fine-tuned ViT")
    return net, [k for k in sd if not k.startswith(EVA02_DET_PREFIX)]


def eva02_det_window_blocks(sd: Mapping[str, Tensor]) -> List[int]:
    """The blocks of an EVA-02 detector's ViT that attend in windows: each block stores the
    rope table it uses (the shared ``rope_win`` on window-local coordinates, or ``rope_glb``
    on the whole grid), so the windowed ones are those whose table equals ``rope_win``'s."""
    net, _ = _eva02_det_net(unwrap_state_dict(sd))
    window = net.get('rope_win.freqs_cos')
    if window is None:
        raise CheckpointError('eva02_det checkpoint: no backbone.net.rope_win.freqs_cos to tell '
                              'window blocks from global ones; give global_attn_indexes '
                              'yourself')
    found = (re.match(r'^blocks\.(\d+)\.attn\.rope\.freqs_cos$', k) for k in net)
    return sorted(int(m.group(1)) for m in found
                  if m and net[m.group(0)].shape == window.shape
                  and torch.equal(net[m.group(0)], window))

