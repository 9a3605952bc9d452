"""DINOv2 / DINOv3 / EVA-02 checkpoints: family detection and timm layout -> ours, pure
``state_dict -> state_dict`` functions, and the strict, reported loader.

Our layout is timm's ``VisionTransformer`` naming (see ``docs`` / the backbone module), which
timm's DINOv2 checkpoints already use; the differences to the timm layouts:

* DINOv2 with registers (timm ``no_embed_class``): ``pos_embed`` has no cls slot and the slot
  is folded into ``cls_token``; ours keeps a cls slot, filled with zeros (the same sum);
* DINOv3 (timm ``Eva``): ``gamma_1`` / ``gamma_2`` -> ``ls1.gamma`` / ``ls2.gamma``;
* EVA-02 B / L (timm ``Eva`` with ``qkv_fused=False``): ``attn.{q,k,v}_proj.weight`` -> one
  ``attn.qkv.weight`` (rows q, k, v), ``attn.q_proj.bias`` / ``attn.v_proj.bias`` ->
  ``attn.q_bias`` / ``attn.v_bias`` (k has no bias);
* classification parts (``head``, ``fc_norm``, ``attn_pool``), ``mask_token`` and timm's rope
  buffers are dropped (reported); ``norm`` too when the model has no final norm.

The position grid is resized to the model's stored grid (bicubic, antialiased: timm's
``checkpoint_filter_fn``).
"""
import functools
import logging
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional import resize_pos_grid
from .checkpoint_io import CheckpointError
from .common import (StateDict, drop_keys, is_square_grid, note_resampled, select_prefix,
                     unwrap_state_dict)
from .official_vit import (DINOV3_ROPE_BASE, OFFICIAL_FAMILIES, detect_official_vit_layout,
                           eva02_rope_grids, official_to_timm)
from .layout import Layout, layouts_of
from .patch_resample import resample_patch_kernel
from ..functional.checkpoint_target import CheckpointTarget

logger = logging.getLogger('vitdet_plugin')

#: The families of this module (:data:`~.layouts.FAMILY_BACKBONES` names their backbones).
VIT_FAMILIES = ('DINOv2', 'DINOv3', 'EVA-02')
#: What a DINOv2 / DINOv3 / EVA-02 loader says when no layout of the table fits a checkpoint.
VIT_FAMILY_UNRECOGNISED = ('not a DINOv2 / DINOv3 / EVA-02 checkpoint (official, timm or our '
                           'layout): expected blocks with LayerScale (DINOv2 / DINOv3) or q / v '
                           'biases (EVA-02)')
#: Layouts :func:`detect_vit_family` names.
FAMILY_LAYOUTS = ('timm', 'ours')
#: Keys of a family checkpoint that are not the backbone's (after prefixes are removed).
_NON_BACKBONE = (r'^head\.', r'^fc_norm\.', r'^attn_pool\.', r'^mask_token$', r'^rope\.',
                 r'^head_drop\.', r'^neck\.', r'^(rpn|roi|bbox|mask)_head\.')
_LAYER_SCALE = re.compile(r'^blocks\.\d+\.(ls1\.gamma|gamma_1)$')
_BLOCK = re.compile(r'^blocks\.(\d+)\.')
_QV_BIAS = re.compile(r'^blocks\.(\d+)\.attn\.(q_bias|q_proj\.weight)$')
_SPLIT_QKV = re.compile(r'^(blocks\.\d+\.attn\.)q_proj\.weight$')


def _inner(sd: Mapping[str, Tensor]) -> StateDict:
    """The backbone's keys of a (detector) state dict: un-prefixed ``backbone.`` if present."""
    return select_prefix(sd, 'backbone.')


def detect_vit_family(sd: Mapping[str, Tensor]) -> Optional[Tuple[str, str]]:
    """``(family, layout)`` of a DINOv2 / DINOv3 / EVA-02 state dict (possibly
    ``backbone.``-prefixed): family one of :data:`VIT_FAMILIES`, layout one of
    :data:`FAMILY_LAYOUTS`; None when it is none of them (e.g. a plain ViT)."""
    sd = _inner(sd)
    keys = list(sd)
    blocks = {m.group(1) for m in map(_BLOCK.match, keys) if m}
    if not blocks:
        return None
    layer_scale = [k for k in keys if _LAYER_SCALE.match(k)]
    # a family marker in every block: a stray key in another ViT's checkpoint is not one
    scaled = {k.split('.')[1] for k in layer_scale} == blocks
    qv = {m.group(1) for m in map(_QV_BIAS.match, keys) if m} == blocks
    has_pos = 'pos_embed' in sd
    timm_only = any(k.startswith(('head.', 'fc_norm.')) for k in keys)
    if scaled and not has_pos and 'reg_token' in sd:
        timm = any(k.endswith('gamma_1') for k in layer_scale)
        return 'DINOv3', 'timm' if timm or timm_only else 'ours'
    if scaled and has_pos and any(k.endswith('ls1.gamma') for k in layer_scale):
        no_slot = 'reg_token' in sd and is_square_grid(sd['pos_embed'].shape[1])
        return 'DINOv2', 'timm' if no_slot or timm_only else 'ours'
    if has_pos and not layer_scale and qv:
        split = any(_SPLIT_QKV.match(k) for k in keys)
        return 'EVA-02', 'timm' if split or timm_only else 'ours'
    return None


def _merge_split_qkv(sd: StateDict) -> StateDict:
    """timm EVA-02 B / L: separate q / k / v projections -> fused ``qkv`` + q / v biases."""
    out: StateDict = {}
    for k, v in sd.items():
        m = _SPLIT_QKV.match(k)
        if m:
            base = m.group(1)
            out[base + 'qkv.weight'] = torch.cat(
                [v, sd[base + 'k_proj.weight'], sd[base + 'v_proj.weight']], dim=0)
            for name in ('q', 'v'):
                if base + f'{name}_proj.bias' in sd:
                    out[base + f'{name}_bias'] = sd[base + f'{name}_proj.bias']
        elif not re.match(r'^blocks\.\d+\.attn\.[kv]_proj\.weight$', k) and not re.match(
                r'^blocks\.\d+\.attn\.[qkv]_proj\.bias$', k):
            out[k] = v
    return out


def convert_vit_family(sd: Mapping[str, Tensor], family: str,
                       target_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                       pos_grid: Optional[Tuple[int, int]] = None,
                       resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """A timm (or our) ``family`` state dict -> our layout, and the dropped source keys.

    ``target_shapes`` (the model's state dict shapes): the final norm and the cls / register
    tokens are dropped too when the model was built without them (``final_norm=False``,
    ``prefix_tokens='drop'``). ``pos_grid``: the model's stored position grid (the position
    embedding is resized to it; ``resampled``, if given, gets ``'<key> <shape> -> <shape>'``
    when its grid changed).
    """
    if family not in VIT_FAMILIES:
        raise ValueError(f'family={family!r} is not one of {sorted(VIT_FAMILIES)}')
    prefixed = any(k.startswith('backbone.') for k in sd)
    dropped = [k for k in sd if not k.startswith('backbone.')] if prefixed else []
    kept, dropped_now = drop_keys(_inner(sd), _NON_BACKBONE)
    dropped += dropped_now
    has_regs = 'reg_token' in kept
    if target_shapes is not None:  # parts the model was built without
        _check_registers(kept, target_shapes)
        absent = [pattern for key, pattern in (('norm.weight', r'^norm\.'),
                                               ('cls_token', r'^cls_token$'),
                                               ('reg_token', r'^reg_token$'))
                  if key not in target_shapes]
        kept, not_built = drop_keys(kept, absent)
        dropped += not_built
    out: StateDict = {}
    for k, v in kept.items():
        out[re.sub(r'\.gamma_([12])$', r'.ls\1.gamma', k)] = v
    if any(_SPLIT_QKV.match(k) for k in out):
        out = _merge_split_qkv(out)
    target_pos = None if target_shapes is None else target_shapes.get('pos_embed')
    if 'pos_embed' in out and (target_pos is None
                               or tuple(target_pos) != tuple(out['pos_embed'].shape)):
        src = out['pos_embed']
        out['pos_embed'] = _pos_embed_with_cls_slot(src, has_regs, pos_grid)
        src_cells = src.shape[1] - (0 if has_regs and is_square_grid(src.shape[1]) else 1)
        if out['pos_embed'].shape[1] - 1 != src_cells:  # the grid was resized, not only slotted
            note_resampled(resampled, 'pos_embed', src.shape, out['pos_embed'].shape)
    return out, dropped


def _check_registers(sd: Mapping[str, Tensor], target_shapes: Mapping[str, Sequence[int]]
                     ) -> None:
    """The model's register tokens must be the checkpoint's (unless the model drops all
    prefix tokens, ``prefix_tokens='drop'``: then it has no cls token either)."""
    if 'cls_token' not in target_shapes:
        return
    have = int(sd['reg_token'].shape[1]) if 'reg_token' in sd else 0
    want = int(target_shapes['reg_token'][1]) if 'reg_token' in target_shapes else 0
    if have != want:
        raise CheckpointError(f'the checkpoint has {have} register tokens, the model was built '
                              f'with num_reg_tokens={want}: build it with num_reg_tokens={have}')


def _pos_embed_with_cls_slot(pos: Tensor, has_regs: bool,
                             grid: Optional[Tuple[int, int]]) -> Tensor:
    """``(1, [1 +] gh * gw, C)`` (a square source grid) -> ``(1, 1 + th * tw, C)`` with the
    cls slot first (zeros where the source folded it into the cls token) and the grid resized
    to ``grid`` (bicubic, antialiased)."""
    n = pos.shape[1]
    folded = has_regs and is_square_grid(n)  # timm's no_embed_class layout (DINOv2 + registers)
    slot = pos.new_zeros(1, 1, pos.shape[-1]) if folded else pos[:, :1]
    cells = pos if folded else pos[:, 1:]
    side = math.isqrt(cells.shape[1])
    if side * side != cells.shape[1]:
        raise CheckpointError(f'pos_embed {tuple(pos.shape)}: expected a cls slot and a square '
                              'grid (timm / DINOv2 / EVA-02 checkpoints)')
    src = cells.reshape(1, side, side, -1).permute(0, 3, 1, 2)       # (1, C, s, s)
    target = (side, side) if grid is None else grid
    resized = resize_pos_grid(src, target, antialias=True)           # (1, C, th, tw)
    return torch.cat([slot, resized.flatten(2).transpose(1, 2)], dim=1).contiguous()


def _check_official_fits(target: CheckpointTarget, sd: Mapping[str, Tensor],
                         layout: str) -> None:
    """Refuse an official EVA-02 checkpoint the target cannot take: EVA-02-det's (no cls
    token) in a model that keeps the prefix tokens, or rope tables of another pretraining
    grid."""
    name = target.owner
    if layout == 'eva02_det' and target.expected is not None and 'cls_token' in target.expected:
        raise CheckpointError(f"the checkpoint is an EVA-02 detector's ViT (EVA-02/det "
                              f"backbone.net.*), which has no cls token; build "
                              f"{name}(prefix_tokens='drop') as EVA-02-det does")
    key = _EVA02_ROPE_KEYS.get(layout)
    grids = eva02_rope_grids(unwrap_state_dict(sd), key) if key else None
    if grids is None or target.rope_temperature is None:
        return
    side = round(grids[1])
    want = (side, side)
    if target.rope_ref_grid != want:
        raise CheckpointError(
            f"the checkpoint's rotary tables are scaled to a {want[0]} x {want[1]} pretraining "
            f'grid, {name} was built with rope ref_grid={target.rope_ref_grid}; build '
            f"{name}(rope=dict(temperature={target.rope_temperature:g}, ref_grid={want}))")


#: The stored EVA-02 rope table that fixes the pretraining grid, per official layout.
_EVA02_ROPE_KEYS = {'eva02': 'rope.freqs_cos', 'eva02_det': 'backbone.net.rope_glb.freqs_cos'}


def _official_options(target: CheckpointTarget, layout: str) -> Dict[str, Any]:
    """``official_to_timm`` options for ``target``: for DINOv3 its rope base, and whether it
    has q / v biases (a model without them takes an official checkpoint only if they are
    zero; None without a model: kept when the checkpoint has them); none for the others."""
    if layout != 'dinov3':
        return {}
    base = DINOV3_ROPE_BASE if target.rope_temperature is None else target.rope_temperature
    qkv_bias = None if target.expected is None else any(
        k.endswith(('.attn.q_bias', '.attn.qkv.bias')) for k in target.expected)
    return dict(rope_base=base, qkv_bias=qkv_bias)


def family_layout(sd: Mapping[str, Tensor]) -> Optional[Tuple[str, str, Optional[str]]]:
    """``(family, layout, official)`` of a DINOv2 / DINOv3 / EVA-02 state dict: ``official``
    its official layout (:data:`~.official_vit.OFFICIAL_VIT_LAYOUTS`) or None, ``layout`` the
    name to report (``'<official> official'``, ``'timm'`` or ``'ours'``); None when it is none
    of these families."""
    official = detect_official_vit_layout(sd)
    if official is not None:
        return OFFICIAL_FAMILIES[official], f'{official} official', official
    found = detect_vit_family(sd)
    return None if found is None else (found[0], found[1], None)


def convert_family_checkpoint(sd: Mapping[str, Tensor], family: str, official: Optional[str],
                              target: CheckpointTarget, resampled: Optional[List[str]] = None
                              ) -> Tuple[StateDict, List[str]]:
    """A ``family`` state dict (``official`` layout, or timm's / ours when None) -> ours for
    ``target``, and the dropped keys. Official layouts go through
    :func:`~.official_vit.official_to_timm` first; a patch kernel of another size than
    ``target.patch_size`` is resampled (FlexiViT,
    :func:`~.patch_resample.resample_patch_kernel`); ``resampled``, if given, gets
    ``'<key> <shape> -> <shape>'`` for every tensor resized."""
    official_dropped: List[str] = []
    if official is not None:  # facebookresearch / baaivision layouts -> timm's, then ours
        _check_official_fits(target, sd, official)
        sd, official_dropped = official_to_timm(sd, official, **_official_options(target,
                                                                                  official))
    converted, dropped = convert_vit_family(sd, family, target.expected, target.pos_grid,
                                            resampled)
    kernel = converted.get('patch_embed.proj.weight')
    want = target.patch_size
    if kernel is not None and want is not None and tuple(kernel.shape[-2:]) != tuple(want):
        # FlexiViT resize: the checkpoint's patch size -> the model's (e.g. 14 -> 16)
        logger.info('%s checkpoint: patch kernel %s resampled to %s', family,
                    tuple(kernel.shape[-2:]), tuple(want))
        converted['patch_embed.proj.weight'] = resample_patch_kernel(kernel, want)
        note_resampled(resampled, 'patch_embed.proj.weight', kernel.shape,
                       converted['patch_embed.proj.weight'].shape)
    return converted, official_dropped + dropped


#: The suffix of an official layout's name (``'dinov2 official'``).
OFFICIAL = ' official'


def family_layout_name(family: str, sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout name of ``sd`` when it is a ``family`` checkpoint (:func:`family_layout`),
    else None: the classifier of ``family``'s layouts."""
    found = family_layout(sd)
    return found[1] if found is not None and found[0] == family else None


def convert_family_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                          resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """The table's DINOv2 / DINOv3 / EVA-02 converter: :func:`convert_family_checkpoint` from
    the official layout ``layout`` names, or from timm's / ours."""
    official = layout.name[:-len(OFFICIAL)] if layout.name.endswith(OFFICIAL) else None
    return convert_family_checkpoint(sd, layout.family, official, target, resampled)


#: The layouts of each family: its official ones (:data:`~.official_vit.OFFICIAL_FAMILIES`),
#: timm's and ours.
LAYOUTS = tuple(
    layout for family in VIT_FAMILIES
    for layout in layouts_of(
        family, tuple(name + OFFICIAL for name, fam in OFFICIAL_FAMILIES.items() if fam == family)
        + FAMILY_LAYOUTS, functools.partial(family_layout_name, family), convert_family_layout))
