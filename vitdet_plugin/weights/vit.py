"""Plain-ViT (ViTDet) checkpoint converters: pure ``state_dict -> state_dict`` functions.

Our layout is timm / SAM / detectron2's ViT naming (``patch_embed.proj``, ``pos_embed`` as
``(1, [1 +] gh * gw, C)``, ``blocks.{i}.{norm1, attn.qkv, attn.proj, attn.rel_pos_h,
attn.rel_pos_w, norm2, mlp.fc1, mlp.fc2, residual.*}``). Accepted sources (:data:`VIT_FORMATS`):

* ``timm_vit``: timm ``VisionTransformer`` / DeiT (``cls_token``, ``dist_token``,
  ``pos_embed (1, prefix + 14*14, C)``, ``norm``, ``fc_norm``, ``head`` dropped);
* ``mae``: MAE pretraining checkpoints (``{'model': sd}``; timm names plus ``mask_token`` /
  ``decoder_*`` when saved with the decoder);
* ``sam``: Segment Anything (``image_encoder.``-prefixed, ``pos_embed (1, 64, 64, C)``, rel-pos
  tables, ``mlp.lin1/lin2``; ``neck``, prompt encoder and mask decoder dropped);
* ``timm_samvit``: timm ``samvit_*`` (SAM names without the prefix, ``mlp.fc1/fc2``);
* ``detectron2``: ViTDet detectors (``backbone.net.*``), as ``.pth`` or model-zoo ``.pkl``
  (numpy arrays, read by a restricted unpickler);
* ``mmpretrain``: mmpretrain ``VisionTransformer`` / MAE (``patch_embed.projection``,
  ``layers.{i}.{ln1, attn, ln2, ffn.layers.0.0, ffn.layers.1}``, final ``ln1``; possibly
  ``backbone.``-prefixed with ``neck`` / ``head`` keys);
* ``ours``: this package's layout (possibly ``backbone.``-prefixed in a detector checkpoint).

Position embeddings are resized bicubically to the target grid and relative-position tables
linearly to the target lengths.

The simple feature pyramid is the neck (``ViTSimpleFPN``), so its weights are not the
backbone's: :func:`simple_fpn_part` reads them from detectron2 ViTDet checkpoints (whose
``backbone.simfp_*`` modules map exactly onto ``ViTSimpleFPN``'s names) and from our detector
checkpoints (``neck.*``; ``backbone.pyramid.*`` where the pyramid sat inside the backbone
before), the neck's ``init_weights`` loads them (:data:`~.layouts.LAYOUTS`), and
:func:`convert_vitdet_to_mmdet` writes a whole ``backbone.*`` + ``neck.*`` detector checkpoint
for ``load_from``.
"""
import logging
import math
import re
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional import resize_pos_grid, resize_rel_pos
from ..functional.checkpoint_target import CheckpointTarget
from .checkpoint_io import CheckpointError
from .common import (StateDict, drop_keys, hw_pair, is_square_grid, note_resampled, select_prefix,
                     unwrap_state_dict)
from .layout import GENERIC, Layout, layouts_of

logger = logging.getLogger('vitdet_plugin')

VIT_FORMATS = ('timm_vit', 'mae', 'sam', 'timm_samvit', 'detectron2', 'mmpretrain', 'ours')

#: Keys that are not the ViT's (after prefixes are removed): classification / pretraining heads
#: and tokens, necks, and the simple pyramid inside our backbone before it was the neck.
_NON_BACKBONE = (r'^cls_token$', r'^dist_token$', r'^reg_token$', r'^mask_token$', r'^norm\.',
                 r'^fc_norm\.', r'^head(_dist)?\.', r'^pre_logits\.', r'^attn_pool\.',
                 r'^decoder_', r'^neck\.', r'^pyramid\.')
#: Layers of each simple-pyramid scale before its 1x1 conv (detectron2 ``simfp_*`` layout).
_RESAMPLE_LAYERS = {4.0: 4, 2.0: 1, 1.0: 0, 0.5: 1}
_SIMFP = re.compile(r'^simfp_(\d+)\.(\d+)\.(.+)$')
#: Simple-pyramid keys as a backbone conversion reports them (dropped): detectron2's and ours.
PYRAMID_KEY = re.compile(r'^(backbone\.)?(simfp_\d+\.|pyramid\.)')
#: Prefixes of the pyramid in our checkpoints: the neck of a detector, and where it sat inside
#: the backbone before it was the neck (a detector's or a backbone's own checkpoint).
_OWN_PYRAMID_PREFIXES = ('neck.', 'backbone.pyramid.', 'pyramid.')
#: ``ViTSimpleFPN``'s own parameter names (a bare neck state dict).
_SIMPLE_FPN_KEY = re.compile(r'^(scales|lateral_convs|output_convs)\.\d+\.')
_REL_POS = re.compile(r'^blocks\.\d+\.attn\.rel_pos_[hw]$')
#: A ViT's parts its source layout may not have (they keep their init when it has none):
#: rel-pos tables (zero init, as ViTDet fine-tuning from MAE) and residual conv blocks.
OPTIONAL_PARTS = (_REL_POS, re.compile(r'^blocks\.\d+\.residual\.'))


#: What a ViT loader says when no layout of the table fits a checkpoint.
VIT_UNRECOGNISED = ("no ViT attention weights found (expected keys like "
                    "'blocks.0.attn.qkv.weight' (timm/MAE/ours), 'image_encoder.blocks.0.attn.qkv."
                    "weight' (SAM), 'backbone.net.blocks.0.attn.qkv.weight' (detectron2) or "
                    "'layers.0.ffn.layers.0.0.weight' (mmpretrain))")


def vit_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout of a plain-ViT state dict (one of :data:`VIT_FORMATS`), or None when it is
    none. DINOv2 / DINOv3 / EVA-02 checkpoints fit too: their layouts win over these
    (:data:`~.layout.GENERIC` priority, :func:`~.layouts.find_layout`)."""
    keys = list(sd)
    if any(k.startswith('image_encoder.') or '.mlp.lin1.' in k for k in keys):
        return 'sam'  # also the encoder alone (prefix removed), named by SAM's MLP layers
    if any(k.startswith('backbone.net.') for k in keys):
        return 'detectron2'
    inner = [k[len('backbone.'):] for k in keys if k.startswith('backbone.')] or keys
    if any(re.match(r'layers\.\d+\.ffn\.layers\.0\.0\.', k) for k in inner):
        return 'mmpretrain'
    if not any(re.match(r'blocks\.\d+\.attn\.qkv\.', k) for k in inner):
        return None
    if len(inner) != len(keys):  # a detector checkpoint with our backbone
        return 'ours'
    pos = sd.get('pos_embed')
    if (pos is not None and pos.dim() == 4) or any(k.startswith('neck.') for k in keys):
        return 'timm_samvit'
    if any(k.startswith('decoder_') or k == 'mask_token' for k in keys):
        return 'mae'
    if any(re.match(r'^(cls_token|dist_token|norm\.|fc_norm\.|head\.)', k) for k in keys):
        return 'timm_vit'
    return 'ours'


def simple_fpn_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """``'detectron2'`` for a bare detectron2 pyramid (``[backbone.]simfp_*`` keys only),
    ``'ours'`` for a bare ``ViTSimpleFPN`` state dict, else None (the pyramid inside a
    detector checkpoint is read by :func:`simple_fpn_part`)."""
    if not sd:
        return None
    if all(re.match(r'^(backbone\.)?simfp_\d+\.', k) for k in sd):
        return 'detectron2'
    return 'ours' if all(_SIMPLE_FPN_KEY.match(k) for k in sd) else None


_MMPRETRAIN_RENAMES = ((r'^patch_embed\.projection\.', 'patch_embed.proj.'),
                       (r'^layers\.(\d+)\.ln1\.', r'blocks.\1.norm1.'),
                       (r'^layers\.(\d+)\.ln2\.', r'blocks.\1.norm2.'),
                       (r'^layers\.(\d+)\.ffn\.layers\.0\.0\.', r'blocks.\1.mlp.fc1.'),
                       (r'^layers\.(\d+)\.ffn\.layers\.1\.', r'blocks.\1.mlp.fc2.'),
                       (r'^layers\.(\d+)\.', r'blocks.\1.'))


def _from_mmpretrain(key: str) -> str:
    for pattern, repl in _MMPRETRAIN_RENAMES:
        key, n = re.subn(pattern, repl, key)
        if n:
            break
    return key


def split_pos_embed(pos: Tensor, num_prefix_tokens: int = 0,
                    grid: Optional[Tuple[int, int]] = None,
                    square_source: bool = False) -> Tuple[Optional[Tensor], Tensor]:
    """Split a position embedding into its prefix slots ``(1, p, C)`` (or None) and its grid
    ``(1, C, gh, gw)``.

    Accepts ``(1, H, W, C)`` (SAM) or ``(1, p + gh * gw, C)``; ``p`` is ``num_prefix_tokens``
    when that leaves a square grid (or ``grid`` if given), else 0 or 1 whichever does.
    ``square_source``: the layout is usually trained on square images (timm, MAE, DeiT,
    detectron2), so a count that is a square grid is read as one even when a non-square
    ``grid`` has as many cells (reading it on that grid would scramble it).
    """
    if pos.dim() == 4:
        return None, pos.permute(0, 3, 1, 2)
    if pos.dim() != 3 or pos.shape[0] != 1:
        raise CheckpointError(f'pos_embed must be (1, N, C) or (1, H, W, C), got '
                              f'{tuple(pos.shape)}')
    n = pos.shape[1]
    p: Optional[int]
    if (grid is not None and square_source and grid[0] != grid[1]
            and is_square_grid(n - num_prefix_tokens)):
        grid = None
    if grid is not None and n - grid[0] * grid[1] in (0, 1, num_prefix_tokens):
        p = n - grid[0] * grid[1]
    else:
        p = next((c for c in (num_prefix_tokens, 0, 1) if is_square_grid(n - c)), None)
        if p is None:
            raise CheckpointError(f'cannot infer the grid of pos_embed {tuple(pos.shape)}: '
                                  f'{n} positions are not a square grid plus 0, 1 or '
                                  f'{num_prefix_tokens} prefix tokens')
        side = math.isqrt(n - p)
        grid = (side, side)
    body = pos[:, p:].reshape(1, grid[0], grid[1], -1).permute(0, 3, 1, 2)
    return (pos[:, :p] if p else None), body


def convert_simple_fpn(sd: Mapping[str, Tensor], in_stride: int = 16) -> StateDict:
    """detectron2 ``simfp_{s}.*`` pyramid keys (prefix removed) -> :class:`ViTSimpleFPN` names.

    Level ``s`` has stride ``2**s``; levels are ordered fine to coarse as ``scale_factors``.
    """
    levels = sorted({int(m.group(1)) for k in sd for m in [_SIMFP.match(k)] if m})
    out: StateDict = {}
    for k, v in sd.items():
        m = _SIMFP.match(k)
        if m is None:
            raise CheckpointError(f'{k!r} is not a detectron2 simple-pyramid key (simfp_S.N.*)')
        s, layer, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        scale = in_stride / 2**s
        if scale not in _RESAMPLE_LAYERS:
            raise CheckpointError(f'{k!r}: stride {2**s} is not reachable from stride '
                                  f'{in_stride} with the supported scale factors')
        i, n = levels.index(s), _RESAMPLE_LAYERS[scale]
        if layer < n:
            out[f'scales.{i}.{layer}.{rest}'] = v
        elif layer in (n, n + 1):
            conv = 'lateral_convs' if layer == n else 'output_convs'
            sub = rest if rest.startswith('norm.') else f'conv.{rest}'
            out[f'{conv}.{i}.{sub}'] = v
        else:
            raise CheckpointError(f'{k!r}: unexpected layer {layer} in pyramid level {s}')
    return out


def simple_fpn_to_detectron2(sd: Mapping[str, Tensor], scale_factors: Sequence[float],
                             in_stride: int = 16) -> StateDict:
    """Inverse of :func:`convert_simple_fpn` (our pyramid names -> ``simfp_{s}.*``)."""
    out: StateDict = {}
    for k, v in sd.items():
        m = re.match(r'^(scales|lateral_convs|output_convs)\.(\d+)\.(.+)$', k)
        if m is None:
            raise CheckpointError(f'{k!r} is not a ViTSimpleFPN key')
        kind, i, rest = m.group(1), int(m.group(2)), m.group(3)
        scale = float(scale_factors[i])
        s, n = round(math.log2(in_stride / scale)), _RESAMPLE_LAYERS[scale]
        if kind == 'scales':
            out[f'simfp_{s}.{rest}'] = v
        else:
            layer = n if kind == 'lateral_convs' else n + 1
            rest = rest[len('conv.'):] if rest.startswith('conv.') else rest
            out[f'simfp_{s}.{layer}.{rest}'] = v
    return out


def _target_pos_layout(shape: Sequence[int],
                       grid: Optional[Tuple[int, int]]) -> Tuple[int, Tuple[int, int]]:
    n = int(shape[1])
    if grid is not None:
        return n - grid[0] * grid[1], tuple(grid)  # type: ignore[return-value]
    p = 0 if is_square_grid(n) else 1
    if not is_square_grid(n - p):
        raise CheckpointError(f'target pos_embed {tuple(shape)} is not a square grid; pass '
                              'pos_grid')
    side = math.isqrt(n - p)
    return p, (side, side)


def _global_blocks(lengths: Mapping[str, int]) -> Optional[List[int]]:
    """Blocks whose rel-pos tables are the longest (global attention spans the whole grid, a
    window only its window), or None when all tables are alike (no role to tell apart)."""
    if len(set(lengths.values())) < 2:
        return None
    longest = max(lengths.values())
    return sorted({int(k.split('.')[1]) for k, n in lengths.items() if n == longest})


def _check_global_blocks(src: Mapping[str, int], dst: Mapping[str, int]) -> None:
    """Refuse to stretch window tables into global blocks and squeeze global ones into
    windows: that is a checkpoint for other ``global_attn_indexes``, not a size change."""
    src_global, dst_global = _global_blocks(src), _global_blocks(dst)
    if src_global is not None and dst_global is not None and src_global != dst_global:
        raise CheckpointError(
            f'the ViT checkpoint has global attention in blocks {src_global} (their rel_pos '
            f'tables are the longest), the model in blocks {dst_global}; build the model with '
            f'global_attn_indexes={tuple(src_global)}')


def convert_vit(sd: Mapping[str, Tensor],
                target_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                pos_grid: Optional[Tuple[int, int]] = None,
                src_format: Optional[str] = None,
                resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """Convert a ViT state dict of any supported layout to ours.

    Args:
        sd: the checkpoint or its state dict (wrappers ``model`` / ``state_dict`` removed).
        target_shapes: ``{name: shape}`` of the target model (its ``CheckpointTarget.expected``):
            ``pos_embed`` is resized (bicubic) to its grid and cls slot, rel-pos tables
            (linear) to its lengths. ``None`` only renames.
        pos_grid: the target's position grid ``(gh, gw)`` (inferred as square if omitted).
        src_format: skip auto-detection (one of :data:`VIT_FORMATS`).
        resampled: if given, gets ``'<key> <shape> -> <shape>'`` for every tensor resized.

    Returns:
        the converted state dict and the names of the source keys dropped (classification
        heads and norms, cls/dist tokens, MAE decoder, SAM neck / prompt encoder / mask
        decoder, detector necks and heads, and the simple pyramid: detectron2's
        ``backbone.simfp_*``, our ``pyramid.*``; :func:`simple_fpn_part` reads those).
    """
    sd = unwrap_state_dict(sd)
    fmt = src_format or vit_layout(sd)
    if fmt is None:
        raise CheckpointError(f'unrecognised checkpoint format: {VIT_UNRECOGNISED}; first keys: '
                              f'{list(sd)[:5]}')
    if fmt not in VIT_FORMATS:
        raise ValueError(f'src_format={fmt!r} is not a ViT format; one of {VIT_FORMATS}')
    dropped: List[str] = []
    prefixes = {'sam': 'image_encoder.', 'detectron2': 'backbone.'}
    prefix = prefixes.get(fmt)
    if prefix is None and fmt in ('ours', 'mmpretrain') and any(
            k.startswith('backbone.') for k in sd):
        prefix = 'backbone.'
    if prefix is not None and any(k.startswith(prefix) for k in sd):
        dropped += [k for k in sd if not k.startswith(prefix)]
        sd = select_prefix(sd, prefix)
    if fmt == 'detectron2':  # the ViT is backbone.net; backbone.simfp_* is the neck's
        dropped += [prefixes['detectron2'] + k for k in sd if not k.startswith('net.')]
        sd = select_prefix({k: v for k, v in sd.items() if k.startswith('net.')}, 'net.')
    if fmt == 'sam':
        sd = {re.sub(r'\.mlp\.lin([12])\.', r'.mlp.fc\1.', k): v for k, v in sd.items()}
    if fmt == 'mmpretrain':
        # the final norms only: a pre-norm (CLIP-style) is part of the features, and a model
        # without one must refuse it (reported as unexpected by the strict load)
        sd, dropped_now = drop_keys(sd, (r'^ln[12]\.', ))
        dropped += dropped_now
        sd = {_from_mmpretrain(k): v for k, v in sd.items()}
    num_prefix = sum(1 for k in ('cls_token', 'dist_token') if k in sd)
    if 'reg_token' in sd:
        num_prefix += sd['reg_token'].shape[1]
    sd, dropped_now = drop_keys(sd, _NON_BACKBONE)
    dropped += dropped_now

    if 'pos_embed' in sd:
        if target_shapes is not None and 'pos_embed' not in target_shapes:
            logger.warning('ViT checkpoint: its trained pos_embed %s is not used, because the '
                           'model has no absolute position embedding (use_abs_pos=False); '
                           'build it with use_abs_pos=True to keep it',
                           tuple(sd['pos_embed'].shape))
            dropped.append('pos_embed')
            del sd['pos_embed']
        else:
            src = sd['pos_embed']
            t_layout = (_target_pos_layout(target_shapes['pos_embed'], pos_grid)
                        if target_shapes is not None else None)
            # a source laid out like the target (e.g. a non-square grid) is read with the
            # target's grid; otherwise its grid must be square to be inferred
            slots, grid = split_pos_embed(src, num_prefix,
                                          grid=t_layout[1] if t_layout is not None else None,
                                          square_source=fmt != 'ours')
            if t_layout is not None:
                t_prefix, t_grid = t_layout
            else:
                t_prefix = 1 if slots is not None else 0
                t_grid = hw_pair(pos_grid if pos_grid is not None else grid.shape[-2:],
                                 'pos_grid')
            if t_grid[0] < grid.shape[-2] or t_grid[1] < grid.shape[-1]:
                logger.warning('ViT checkpoint: pos_embed grid %s is downsampled to the model\'s '
                               '%s; set pretrain_img_size to the checkpoint\'s image size (and '
                               'pretrain_use_cls_token to match) to keep it exactly',
                               tuple(grid.shape[-2:]), t_grid)
            src_grid = tuple(grid.shape[-2:])
            grid = resize_pos_grid(grid, t_grid).permute(0, 2, 3, 1).flatten(1, 2)
            if t_prefix:
                cls = (slots[:, :1] if slots is not None
                       else grid.new_zeros(1, 1, grid.shape[-1]))
                grid = torch.cat([cls, grid], dim=1)
            if src_grid != tuple(t_grid):
                note_resampled(resampled, 'pos_embed', src.shape, grid.shape)
            sd['pos_embed'] = grid.contiguous()
    if target_shapes is not None:
        tables = [k for k in sd if _REL_POS.match(k) and k in target_shapes]
        _check_global_blocks({k: sd[k].shape[0] for k in tables},
                             {k: int(target_shapes[k][0]) for k in tables})
        for k in tables:
            length = int(target_shapes[k][0])
            if sd[k].shape[0] != length:
                table = resize_rel_pos(sd[k], length)
                note_resampled(resampled, k, sd[k].shape, table.shape)
                sd[k] = table
    return sd, dropped


def simple_fpn_part(sd: Mapping[str, Tensor], in_stride: int = 16) -> Tuple[StateDict, List[str]]:
    """The simple-pyramid weights of a checkpoint under ``ViTSimpleFPN``'s names, and the source
    keys they came from.

    Read, in this order: detectron2's ``[backbone.]simfp_*`` (levels placed by ``in_stride``,
    the backbone stride), our ``neck.*`` / ``backbone.pyramid.*`` / ``pyramid.*``, or a bare
    ``ViTSimpleFPN`` state dict. :class:`CheckpointError` when none is there.
    """
    sd = unwrap_state_dict(sd)
    for prefix in ('backbone.', ''):
        simfp = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix + 'simfp_')}
        if simfp:
            return convert_simple_fpn(simfp, in_stride), [prefix + k for k in simfp]
    for prefix in _OWN_PYRAMID_PREFIXES:
        own = [k for k in sd if k.startswith(prefix)]
        if own:
            return {k[len(prefix):]: sd[k] for k in own}, own
    if sd and all(_SIMPLE_FPN_KEY.match(k) for k in sd):
        return dict(sd), list(sd)
    raise CheckpointError(
        'no simple-pyramid weights in the checkpoint: expected detectron2 ViTDet keys '
        "('backbone.simfp_2.0.weight'), a detector of ours ('neck.lateral_convs.0.conv.weight' "
        "or 'backbone.pyramid.lateral_convs.0.conv.weight') or ViTSimpleFPN names "
        f"('lateral_convs.0.conv.weight'); first keys: {list(sd)[:5]}")


def convert_vitdet_to_mmdet(sd: Mapping[str, Tensor],
                            target_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                            pos_grid: Optional[Tuple[int, int]] = None,
                            in_stride: int = 16) -> Tuple[StateDict, List[str]]:
    """A ViT checkpoint (any format) -> ``backbone.*`` keys of an mmdet detector built with
    ``ViTBackbone`` and, when it has a simple pyramid (detectron2's ``simfp_*``, our
    ``backbone.pyramid.*``), ``neck.*`` keys of its ``ViTSimpleFPN`` neck: a file for
    ``load_from``. ``target_shapes`` describe the backbone (unprefixed).

    Returns the detector state dict and the dropped source keys (detectron2's RPN / ROI heads
    are not converted).
    """
    sd = unwrap_state_dict(sd)
    backbone, dropped = convert_vit(sd, target_shapes, pos_grid)
    out = {f'backbone.{k}': v for k, v in backbone.items()}
    if any(PYRAMID_KEY.match(k) for k in dropped):
        neck, _ = simple_fpn_part(sd, in_stride)
        out.update({f'neck.{k}': v for k, v in neck.items()})
        dropped = [k for k in dropped if not PYRAMID_KEY.match(k)]
    return out, dropped


def convert_vit_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                       resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """The table's plain-ViT converter: :func:`convert_vit` to ``target``'s shapes and grid."""
    return convert_vit(sd, target.expected, target.pos_grid, layout.name, resampled)


def convert_simple_fpn_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                              resampled: Optional[List[str]] = None
                              ) -> Tuple[StateDict, List[str]]:
    """The table's simple-pyramid converter: :func:`simple_fpn_part` (the pyramid is found by
    its keys wherever it sits, so ``layout`` only names it) placed by ``target.in_stride``; the
    other keys are dropped."""
    del layout, resampled  # nothing to resize
    part, used = simple_fpn_part(sd, target.in_stride)
    taken = set(used)
    return part, [k for k in sd if k not in taken]


#: The family of ``ViTSimpleFPN``: a pyramid, read out of any checkpoint that has one.
NECK = 'simple FPN'
#: The plain-ViT layouts of the table (generic: the ViT families share their keys) and the
#: bare simple pyramids (detectron2's ``simfp_*``, ours).
LAYOUTS = (layouts_of('ViT', VIT_FORMATS, vit_layout, convert_vit_layout, GENERIC)
           + layouts_of(NECK, ('detectron2', 'ours'), simple_fpn_layout,
                        convert_simple_fpn_layout))
