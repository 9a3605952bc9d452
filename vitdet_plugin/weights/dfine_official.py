"""The official D-FINE (Peterande/D-FINE) and DEIMv2 (Intellindust-AI-Lab/DEIMv2) checkpoints
-> our parts. Pure ``state_dict -> state_dict`` functions and three layouts of the table
(:data:`LAYOUTS`, ``official``: D-FINE, DEIMv2 with HGNetV2, DEIMv2 with DINOv3).

The repositories save ``{'model': sd}`` or ``{'ema': {'module': sd}}`` (training checkpoints
hold both; their tools load the EMA weights, :func:`read_official_checkpoint` too) with the
detector's ``backbone.`` / ``encoder.`` / ``decoder.`` modules:

* backbone: HGNetV2 ``stem.*`` / ``stages.*`` (our names), or DEIMv2's DINOv3 STA: the ViT
  (``dinov3._model.*``, the distilled ViT-Tiny of S / M, in our names; ``dinov3.*``, Meta's
  DINOv3 of L / X, through the table's official DINOv3 layout), ``sta.*`` and ``convs`` /
  ``norms`` (our ``sta.*`` / ``fusion_proj.*``);
* encoder: ``HybridEncoder`` (AIFI ``encoder.{level}.layers.{i}`` with a fused ``in_proj``,
  RepNCSPELAN ``cv1``..``cv4``) or ``LiteEncoder`` (``down_sample{1,2}``, ``bi_fusion``);
* decoder: :data:`~.dfine_keys.DECODER_RULES` / :data:`~.dfine_keys.SELECTOR_RULES` (one
  table for the official and the transformers spellings) once the fused ``in_proj`` and
  DEIMv2's ``swish_ffn.w12`` are split, RMSNorm ``scale`` read as ``weight``; its input
  projections (``input_proj``, D-FINE X) become ``decoder_input_proj.*``.

Every tensor is accounted for: a part's unknown keys are refused naming them; buffers rebuilt
from arguments (``anchors``, ``valid_mask``, ``num_points_scale``, the ViT's rope periods:
checked; ``up`` / ``reg_scale``: compare them with the decoder's through
:func:`~.dfine_keys.check_bins` with ``prefix='decoder.decoder.'``) are dropped and reported. A
checkpoint of another size than the part is refused naming the config of its size.

:func:`official_to_detector` maps a whole official detector onto our mmdet detector
(``SingleStageDetector`` with ``DFineHead``: ``backbone.`` / ``neck.`` / ``bbox_head.``), e.g.
``configs/deimv2/deimv2_*.py`` (their heads have ``enc_output=False``: the official DEIMv2
decoder scores the memory as it is), strictly: every official tensor used or one of the
rebuilt buffers, every tensor of the detector given.
"""
import functools
import os
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..functional.checkpoint_target import CheckpointTarget
from .checkpoint_io import CheckpointError
from .common import StateDict, check_state_dict, load_checkpoint_file, unwrap_state_dict
from .deimv2 import (DEIMV2, DEIMV2_DINOV3, DFINE, DINOV3_STA, FAMILY_MODULES, HGNETV2, HYBRID,
                     LITE, PartsLayout)
from .dfine_keys import DECODER_CONSTANTS, DECODER_RULES, SELECTOR_RULES, check_bins
from .layout import CLASS_NAMED, Layout
from .official_vit import DINOV3_ROPE_BASE, dinov3_periods
from .rfdetr_keys import rename
from .vit_families import LAYOUTS as VIT_FAMILY_LAYOUTS

#: The layout name of the three families.
OFFICIAL = 'official'
#: The key that proves an official detector (its first decoder layer's deformable offsets).
_DECODER_MARK = 'decoder.decoder.layers.0.cross_attn.sampling_offsets.weight'
_HGNETV2_MARK = 'backbone.stem.stem1.conv.weight'
#: The configs of the published sizes by (family, decoder width, decoder layers, backbone
#: HG blocks or ViT width), read from the official models' ``state_dict()``.
SIZE_CONFIGS: Mapping[Tuple[str, int, int, int], str] = {
    (DFINE, 128, 3, 5): 'configs/dfine/dfine_n.py',
    (DFINE, 256, 3, 5): 'configs/dfine/dfine_s.py',
    (DFINE, 256, 4, 6): 'configs/dfine/dfine_m.py',
    (DFINE, 256, 6, 6): 'configs/dfine/dfine_l.py',
    (DFINE, 256, 6, 10): 'configs/dfine/dfine_x.py',
    (DEIMV2, 64, 3, 3): 'configs/deimv2/deimv2_atto.py',
    (DEIMV2, 96, 3, 3): 'configs/deimv2/deimv2_femto.py',
    (DEIMV2, 112, 3, 4): 'configs/deimv2/deimv2_pico.py',
    (DEIMV2, 128, 3, 5): 'configs/deimv2/deimv2_n.py',
    (DEIMV2_DINOV3, 192, 4, 192): 'configs/deimv2/deimv2_s.py',
    (DEIMV2_DINOV3, 256, 4, 256): 'configs/deimv2/deimv2_m.py',
    (DEIMV2_DINOV3, 224, 4, 384): 'configs/deimv2/deimv2_l.py',
    (DEIMV2_DINOV3, 256, 6, 384): 'configs/deimv2/deimv2_x.py',
}

#: Fused tensors -> the names of their equal dim-0 chunks (nn.MultiheadAttention's q / k / v;
#: DEIMv2's SwiGLU ``w12``: the first half is gated by SiLU).
_FUSED = ((re.compile(r'\.self_attn\.in_proj_(weight|bias)$'),
           ('.self_attn.q_proj.', '.self_attn.k_proj.', '.self_attn.v_proj.')),
          (re.compile(r'\.swish_ffn\.w12\.(weight|bias)$'), ('.mlp.gate_proj.', '.mlp.up_proj.')))
_BLOCK = r'^((?:fpn|pan)_blocks\.\d+\.|fpn_block\.|pan_block\.)'
#: The encoder's official names (under ``encoder.``) -> ours; first match wins.
ENCODER_RULES: Tuple[Tuple[str, str], ...] = (
    (r'^input_proj\.(\d+)\.(conv|norm)\.', r'input_proj.\1.\2.'),
    (r'^encoder\.(\d+)\.layers\.(\d+)\.self_attn\.(out_proj|[qkv]_proj)\.', r'aifi.\1.\2.\3.'),
    (r'^encoder\.(\d+)\.layers\.(\d+)\.linear([12])\.', r'aifi.\1.\2.fc\3.'),
    (r'^encoder\.(\d+)\.layers\.(\d+)\.(norm[12])\.', r'aifi.\1.\2.\3.'),
    (r'^lateral_convs\.(\d+)\.(conv|norm)\.', r'lateral_convs.\1.\2.'),
    (r'^downsample_convs\.(\d+)\.0\.cv([12])\.', r'downsample_convs.\1.conv\2.'),
    (_BLOCK + r'cv1\.', r'\1conv_in.'),
    (_BLOCK + r'cv2\.0\.', r'\1branches.0.csp.'),
    (_BLOCK + r'cv2\.1\.', r'\1branches.0.conv.'),
    (_BLOCK + r'cv3\.0\.', r'\1branches.1.csp.'),
    (_BLOCK + r'cv3\.1\.', r'\1branches.1.conv.'),
    (_BLOCK + r'cv4\.', r'\1conv_out.'),
    (r'^down_sample([12])\.1\.', r'down\1.conv.conv.'),
    (r'^down_sample([12])\.2\.', r'down\1.conv.norm.'),
    (r'^bi_fusion\.cv\.', 'gap_fusion.'),
)
#: DEIMv2's STA adapter and fusion projections (under ``backbone.``) -> ours.
STA_RULES: Tuple[Tuple[str, str], ...] = (
    (r'^sta\.stem\.0\.', 'sta.stem_conv.conv.'), (r'^sta\.stem\.1\.', 'sta.stem_conv.norm.'),
    (r'^sta\.conv2\.0\.', 'sta.conv2.conv.'), (r'^sta\.conv2\.1\.', 'sta.conv2.norm.'),
    (r'^sta\.conv([34])\.1\.', r'sta.conv\1.conv.'),
    (r'^sta\.conv([34])\.2\.', r'sta.conv\1.norm.'),
    (r'^convs\.(\d+)\.', r'fusion_proj.\1.conv.'), (r'^norms\.(\d+)\.', r'fusion_proj.\1.norm.'),
)
#: Decoder buffers our modules rebuild from their arguments.
_DECODER_BUFFERS = re.compile(r'^(?:anchors|valid_mask|decoder\.(?:up|reg_scale)|'
                              r'decoder\.layers\.\d+\.cross_attn\.num_points_scale)$')
_DECODER_INPUT_PROJ = re.compile(r'^input_proj\.(\d+)\.(conv|norm)\.')
_STA_VIT = ('dinov3._model.', 'dinov3.')


def official_family(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The family of an official D-FINE / DEIMv2 detector state dict, or None."""
    if _DECODER_MARK not in sd:
        return None
    if any(k.startswith('backbone.sta.') for k in sd):
        return DEIMV2_DINOV3
    if _HGNETV2_MARK not in sd:
        return None  # another detector of the repositories (RT-DETR's ResNets)
    return DEIMV2 if any('.swish_ffn.' in k for k in sd) else DFINE


def read_official_checkpoint(checkpoint: Union[str, os.PathLike, Mapping]) -> StateDict:
    """The detector state dict of an official checkpoint (a file read safely, or a loaded
    dict): its EMA weights (``ema.module``) when it has them, as the repositories' inference
    and export tools load it, else ``model``."""
    ckpt = (load_checkpoint_file(checkpoint) if isinstance(checkpoint, (str, os.PathLike))
            else checkpoint)
    if isinstance(ckpt, Mapping) and isinstance(ckpt.get('ema'), Mapping):
        return unwrap_state_dict(ckpt['ema'])
    return unwrap_state_dict(ckpt)


def official_detector_state(ckpt: object) -> Optional[StateDict]:
    """The detector state dict of a loaded official D-FINE / DEIMv2 checkpoint (``{'model':
    sd}`` / ``{'ema': {'module': sd}}``, :func:`read_official_checkpoint`), or None when
    ``ckpt`` is not one."""
    if not isinstance(ckpt, Mapping) or not any(isinstance(ckpt.get(k), Mapping)
                                                for k in ('model', 'ema')):
        return None
    try:
        sd = read_official_checkpoint(ckpt)
    except CheckpointError:
        return None
    return sd if official_family(sd) is not None else None


def official_size(sd: Mapping[str, Tensor]) -> Tuple[Tuple[str, int, int, int], Optional[str]]:
    """The size signature of an official detector state dict and the config of that size
    (None: not a published size)."""
    family = official_family(sd)
    if family is None:
        raise CheckpointError('not an official D-FINE / DEIMv2 detector state dict (no '
                              f'{_DECODER_MARK!r})')
    width = int(sd['decoder.denoising_class_embed.weight'].shape[1])
    layers = len({k.split('.')[3] for k in sd if k.startswith('decoder.decoder.layers.')})
    if family == DEIMV2_DINOV3:
        vit = next(k for k in sd if k.startswith('backbone.dinov3') and k.endswith('cls_token'))
        scale = int(sd[vit].shape[-1])
    else:
        scale = len({'.'.join(k.split('.')[:5]) for k in sd
                     if k.startswith('backbone.stages.') and '.blocks.' in k})
    signature = (family, width, layers, scale)
    return signature, SIZE_CONFIGS.get(signature)


def split_fused(sd: Mapping[str, Tensor]) -> StateDict:
    """``sd`` with every fused tensor (:data:`_FUSED`) split into its named chunks."""
    out: StateDict = {}
    for key, value in sd.items():
        for pattern, names in _FUSED:
            m = pattern.search(key)
            if m:
                for name, chunk in zip(names, value.chunk(len(names))):
                    out[key[:m.start()] + name + m.group(1)] = chunk
                break
        else:
            out[key] = value
    return out


def _under(sd: Mapping[str, Tensor], prefix: str) -> StateDict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _renamed(part: Mapping[str, Tensor], rules: Sequence[Tuple[str, str]], prefix: str,
             what: str) -> StateDict:
    """``part`` renamed by ``rules``; a key no rule knows is refused (named with ``prefix``)."""
    out, unknown = {}, []
    for key, value in part.items():
        new = rename(key, rules)
        if new is None:
            unknown.append(prefix + key)
        else:
            out[new] = value
    if unknown:
        raise CheckpointError(f'official {what}: {len(unknown)} keys no rule knows: '
                              f'{unknown[:5]}; is this a D-FINE / DEIMv2 checkpoint of the '
                              'official repositories?')
    return out


def encoder_part(sd: Mapping[str, Tensor]) -> StateDict:
    """The hybrid / lite encoder of an official detector state dict in our names."""
    return _renamed(split_fused(_under(sd, 'encoder.')), ENCODER_RULES, 'encoder.', 'encoder')


def backbone_part(sd: Mapping[str, Tensor],
                  vit_expected: Optional[Mapping[str, torch.Size]] = None
                  ) -> Tuple[StateDict, List[str]]:
    """The backbone of an official detector state dict in our names (HGNetV2, or DEIMv2's
    DINOv3 STA with its ViT under ``vit.``; ``vit_expected``: the ViT's ``{name: shape}``, for
    Meta's DINOv3 layout), and the keys dropped."""
    part = _under(sd, 'backbone.')
    if official_family(sd) != DEIMV2_DINOV3:
        return _renamed(part, ((r'^(stem|stages)\.', r'\1.'),), 'backbone.', 'HGNetV2'), []
    vit_prefix = next(p for p in _STA_VIT if any(k.startswith(p) for k in part))
    vit = _under(part, vit_prefix)
    rest = {k: v for k, v in part.items() if not k.startswith(vit_prefix)}
    out = {'vit.' + k: v for k, v in _vit(vit, vit_expected, 'backbone.' + vit_prefix).items()}
    out.update(_renamed(rest, STA_RULES, 'backbone.', 'DINOv3 STA'))
    dropped = ['backbone.' + vit_prefix + k for k in vit if k == 'rope_embed.periods'
               or k == 'mask_token' or k.endswith('.bias_mask')]
    return out, dropped


def _vit(vit: StateDict, expected: Optional[Mapping[str, torch.Size]],
         prefix: str) -> StateDict:
    """DEIMv2's ViT in our names: the distilled ViT-Tiny's are ours (its rope periods checked,
    then dropped); Meta's DINOv3 goes through the table's official DINOv3 layout."""
    periods = vit.get('rope_embed.periods')
    if periods is not None:
        want = dinov3_periods(4 * periods.numel(), DINOV3_ROPE_BASE).to(periods.dtype)
        if not torch.allclose(periods, want):
            raise CheckpointError(f'{prefix}rope_embed.periods are not the rope periods of base '
                                  f'{DINOV3_ROPE_BASE:g} our DINOv3 ViT computes')
    if prefix.endswith('._model.'):
        return {k: v for k, v in vit.items() if k != 'rope_embed.periods'}
    layout = next(lay for lay in VIT_FAMILY_LAYOUTS
                  if lay.family == 'DINOv3' and lay.name == 'dinov3 official')
    target = CheckpointTarget('DINOv3', 'DINOv3STABackbone', expected)
    converted, _ = layout.convert(vit, target)
    return converted


def head_part(sd: Mapping[str, Tensor]) -> Tuple[StateDict, List[str]]:
    """The decoder (``decoder.``), query selector (``selector.``), denoising embedding
    (``dn_label_embed.``) and decoder input projections (``decoder_input_proj.``) of an
    official detector state dict in our names, and the buffers dropped (rebuilt from the
    modules' arguments)."""
    out: StateDict = {}
    dropped, unknown = [], []
    for key, value in split_fused(_under(sd, 'decoder.')).items():
        if _DECODER_BUFFERS.match(key) or key in DECODER_CONSTANTS:
            dropped.append('decoder.' + key)
            continue
        m = _DECODER_INPUT_PROJ.match(key)
        inner = key[len('decoder.'):] if key.startswith('decoder.') else key
        if inner.endswith('.scale'):  # DEIMv2's RMSNorm
            inner = inner[:-len('scale')] + 'weight'
        new = (f'decoder_input_proj.{m.group(1)}.{m.group(2)}.{key[m.end():]}' if m
               else rename(key, SELECTOR_RULES))
        if new is None:
            decoder_key = rename(inner, DECODER_RULES)
            new = None if decoder_key is None else 'decoder.' + decoder_key
        if new is None:
            unknown.append('decoder.' + key)
        else:
            out[new] = value
    if unknown:
        raise CheckpointError(f'official decoder: {len(unknown)} keys no rule knows: '
                              f'{unknown[:5]}; is this a D-FINE / DEIMv2 checkpoint of the '
                              'official repositories?')
    return out, dropped


def official_parts(sd: Mapping[str, Tensor],
                   vit_expected: Optional[Mapping[str, torch.Size]] = None
                   ) -> Tuple[Dict[str, StateDict], List[str]]:
    """Every part of an official detector state dict in our names: ``{'backbone': ...,
    'neck': ..., 'head': ...}`` (head keys as :func:`head_part`), and the keys dropped. A key
    outside ``backbone.`` / ``encoder.`` / ``decoder.`` is refused."""
    stray = [k for k in sd if not k.startswith(('backbone.', 'encoder.', 'decoder.'))]
    if stray:
        raise CheckpointError(f'official detector state dict with keys outside backbone. / '
                              f'encoder. / decoder.: {stray[:5]}')
    backbone, dropped = backbone_part(sd, vit_expected)
    head, head_dropped = head_part(sd)
    return {'backbone': backbone, 'neck': encoder_part(sd), 'head': head}, \
        dropped + head_dropped


def _size_refusal(sd: Mapping[str, Tensor], owner: str, converted: Mapping[str, Tensor],
                  expected: Mapping[str, torch.Size]) -> Optional[str]:
    """The refusal when ``converted`` does not fit ``expected`` (naming the config of the
    checkpoint's size), or None."""
    missing = sorted(set(expected) - set(converted))
    extra = sorted(set(converted) - set(expected))
    shapes = [k for k in converted if k in expected and converted[k].shape != expected[k]]
    if not (missing or extra or shapes):
        return None
    (family, width, layers, scale), config = official_size(sd)
    size = (f'the {family} size of {config}' if config else
            f'an unpublished {family} size (decoder width {width}, {layers} layers)')
    detail = '; '.join(f'{name}: {keys[:3]}' for name, keys in
                       (('missing', missing), ('unexpected', extra), ('shape differs', shapes))
                       if keys)
    fix = f'build it with {config}' if config else "build it with the checkpoint's own sizes"
    return (f'the official checkpoint is {size}, which {owner} does not fit ({detail}): {fix}')


def convert_official_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                            resampled: Optional[List[str]] = None
                            ) -> Tuple[StateDict, List[str]]:
    """The table's converter: the part ``target.family`` names, checked against
    ``target.expected`` (a part of another size is refused naming the config of the
    checkpoint's size)."""
    family = target.family
    expected = target.expected
    if family in (HGNETV2, DINOV3_STA):
        vit_expected = None if expected is None else \
            {k[len('vit.'):]: s for k, s in expected.items() if k.startswith('vit.')}
        part, _ = backbone_part(sd, vit_expected)
        roots: Tuple[str, ...] = ('backbone.',)
    elif family in (HYBRID, LITE):
        part = encoder_part(sd)
        kind = LITE if any(k.startswith('fpn_block.') for k in part) else HYBRID
        if kind != family:
            raise CheckpointError(f'{layout.describe()} holds a {kind} (its encoder keys), not '
                                  f"a {family}: build type='{FAMILY_MODULES[kind]}'")
        roots = ('encoder.',)
    else:
        parts = layout.parts if isinstance(layout, PartsLayout) else ()
        raise CheckpointError(f'{layout.describe()} holds no {family} weights for '
                              f"{target.owner}: load it into "
                              f"{' / '.join(FAMILY_MODULES[p] for p in parts)}")
    if expected is not None:
        if HGNETV2 == family:
            part = _with_bn_counters(part, expected)
        refusal = _size_refusal(sd, target.owner, part, expected)
        if refusal:
            raise CheckpointError(refusal)
    return part, [k for k in sd if not k.startswith(roots)]


def official_to_detector(sd: Mapping[str, Tensor], expected: Optional[Mapping[str, torch.Size]],
                         owner: str = 'the detector',
                         bins: Optional[Tuple[float, float]] = None
                         ) -> Tuple[StateDict, List[str]]:
    """An official detector state dict (:func:`read_official_checkpoint`) in our detector's
    names, checked strictly against ``expected`` (the detector's ``{name: shape}``), and the
    buffers dropped (rebuilt by our modules). A detector of another size is refused naming the
    config of the checkpoint's size; ``bins``: the head's ``(up, reg_scale)``, compared with
    the checkpoint's. ``expected=None`` converts names only (``tools/convert_weights.py``): an
    HGNetV2 detector as saved; a DINOv3 one is refused (Meta's DINOv3 layout converts for a
    given model)."""
    family = official_family(sd)
    if expected is None:
        if family == DEIMV2_DINOV3:
            _, config = official_size(sd)
            raise CheckpointError(
                f'the {family} official checkpoint converts for a given model (its DINOv3 '
                f"layout): load the file itself with load_from=FILE in {config or 'its config'} "
                "(or the detector's init_cfg=dict(type='Pretrained', checkpoint=FILE))")
        parts, dropped = official_parts(sd)
        out = {'backbone.' + k: v for k, v in parts['backbone'].items()}
        out.update({'neck.' + k: v for k, v in parts['neck'].items()})
        out.update({'bbox_head.' + _head_name(k): v for k, v in parts['head'].items()})
        return out, dropped
    vit_expected = {k[len('backbone.vit.'):]: s for k, s in expected.items()
                    if k.startswith('backbone.vit.')}
    parts, dropped = official_parts(sd, vit_expected or None)
    out = {'backbone.' + k: v for k, v in parts['backbone'].items()}
    out.update({'neck.' + k: v for k, v in parts['neck'].items()})
    out.update({'bbox_head.' + _head_name(k): v for k, v in parts['head'].items()})
    out = _with_bn_counters(out, expected)
    refusal = _size_refusal(sd, owner, out, expected)
    if refusal:
        raise CheckpointError(refusal)
    if bins is not None:
        check_bins(sd, *bins, prefix='decoder.decoder.')
    check_state_dict(out, expected, source=f'{family} official checkpoint', owner=owner,
                     dropped=dropped)
    return out, dropped


def _head_name(key: str) -> str:
    """A :func:`head_part` key in the head's names (its ``input_proj``)."""
    return ('input_proj.' + key[len('decoder_input_proj.'):]
            if key.startswith('decoder_input_proj.') else key)


def _with_bn_counters(part: StateDict, expected: Mapping[str, torch.Size]) -> StateDict:
    """``part`` with a zero ``num_batches_tracked`` for every BatchNorm counter it lacks."""
    out = dict(part)
    for k in expected:
        if k.endswith('.num_batches_tracked') and k not in out:
            out[k] = torch.zeros((), dtype=torch.long)
    return out


def _classify(family: str, sd: Mapping[str, Tensor]) -> Optional[str]:
    return OFFICIAL if official_family(sd) == family else None


#: The layouts of this module: each detector family's official checkpoints, loaded by its
#: backbone and encoder parts (over the HGNetV2-only ``official`` layout their backbone fits).
LAYOUTS: Tuple[Layout, ...] = tuple(
    PartsLayout(family, OFFICIAL, functools.partial(_classify, family),
                convert_official_layout, CLASS_NAMED, parts=parts)
    for family, parts in ((DFINE, (HGNETV2, HYBRID)), (DEIMV2, (HGNETV2, HYBRID, LITE)),
                          (DEIMV2_DINOV3, (DINOV3_STA, HYBRID))))
