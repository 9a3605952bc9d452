"""D-FINE / DEIMv2 checkpoints -> our parts: ``HGNetV2Backbone``, ``DINOv3STABackbone``,
``HybridEncoder`` and ``LiteEncoder``. Pure ``state_dict -> state_dict`` functions, layouts of
the table (:data:`LAYOUTS`):

* transformers folders (``save_pretrained`` of ``DFineForObjectDetection`` / ``DFineModel``,
  ``Deimv2ForObjectDetection`` / ``Deimv2Model``; keys under ``model.`` or bare), one layout per
  detector and backbone kind, each loaded by every part it holds: the backbone
  (``backbone.model.*`` / ``conv_encoder.model.*`` HGNetV2, ``conv_encoder.backbone.*`` DINOv3
  with ``conv_encoder.spatial_tuning_adapter.*`` and ``conv_encoder.fusion_proj.*``), the
  encoder (``encoder.*`` with D-FINE's ``encoder_input_proj.{i}.{0,1}`` or DEIMv2's
  ``conv_encoder.encoder_input_proj.{i}.{conv,norm}``); the decoder is dropped (reported);
* a transformers ``HGNetV2Backbone`` / ``HGNetV2ForImageClassification`` folder
  (``embedder.*``, ``encoder.stages.*``);
* the reference repositories' HGNetV2 (``stem.*``, ``stages.*``: our names; a detector's under
  ``backbone.``).

transformers' backbones hold frozen BatchNorms (no ``num_batches_tracked``): ours get 0. An
HGNetV2 with fewer stages than the checkpoint takes its first stages (DEIMv2's Femto / Pico start
from B0's weights), the rest reported as dropped. The DINOv3 part goes through the transformers
DINOv3 layout (:mod:`.transformers_layouts`); the LayerScale of 1 transformers gives DEIMv2's
ViT-Tiny is dropped when ours has none, and its missing k bias read as zeros.
"""
import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional.checkpoint_target import CheckpointTarget
from .checkpoint_io import CheckpointError
from .common import StateDict
from .layout import CLASS_NAMED, SPECIFIC, Layout
from .transformers_layouts import LAYOUTS as TRANSFORMERS_LAYOUTS

#: The families of our parts.
HGNETV2, DINOV3_STA, HYBRID, LITE = 'HGNetV2', 'DINOv3 STA', 'HybridEncoder', 'LiteEncoder'
#: The detector families and what loads each (its backbone part, for messages).
DFINE, DEIMV2, DEIMV2_DINOV3 = 'D-FINE', 'DEIMv2', 'DEIMv2 DINOv3'
FAMILY_MODULES = {HGNETV2: 'HGNetV2Backbone', DINOV3_STA: 'DINOv3STABackbone',
                  HYBRID: 'HybridEncoder', LITE: 'LiteEncoder', DFINE: 'HGNetV2Backbone',
                  DEIMV2: 'HGNetV2Backbone', DEIMV2_DINOV3: 'DINOv3STABackbone'}

#: Each transformers detector layout: the key that proves it (after an optional ``model.``)
#: and the parts that load it.
_DETECTORS = {
    'transformers DFine': (DFINE, 'backbone.model.embedder.stem1.convolution.weight',
                           (HGNETV2, HYBRID)),
    'transformers Deimv2': (DEIMV2, 'conv_encoder.model.embedder.stem1.convolution.weight',
                            (HGNETV2, HYBRID, LITE)),
    'transformers Deimv2 DINOv3': (
        DEIMV2_DINOV3, 'conv_encoder.spatial_tuning_adapter.stem_conv.conv.weight',
        (DINOV3_STA, HYBRID)),
}
_TRANSFORMERS_HGNETV2 = 'transformers HGNetV2'
_OFFICIAL_HGNETV2 = 'official'
_OFFICIAL_STEM = 'stem.stem1.conv.weight'
#: Where each detector layout keeps its HGNetV2 and its encoder's input projections.
_HGNETV2_PREFIX = {'transformers DFine': 'backbone.model.',
                   'transformers Deimv2': 'conv_encoder.model.', _TRANSFORMERS_HGNETV2: ''}
_INPUT_PROJ = {'transformers DFine': (re.compile(r'^encoder_input_proj\.(\d+)\.([01])\.'),
                                      {'0': 'conv', '1': 'norm'}),
               'transformers Deimv2': (
                   re.compile(r'^conv_encoder\.encoder_input_proj\.(\d+)\.(conv|norm)\.'),
                   {'conv': 'conv', 'norm': 'norm'})}

#: transformers' HGNetV2 names -> the reference's (ours).
_HGNETV2_RENAMES = ((r'^embedder\.', 'stem.'), (r'^encoder\.stages\.', 'stages.'),
                    (r'\.convolution\.', '.conv.'), (r'\.normalization\.', '.bn.'))
#: An AIFI layer of transformers' encoder: ``aifi.{level}.layers.{i}.`` in memory,
#: ``encoder.{level}.layers.{i}.`` on disk (transformers' D-FINE conversion mapping).
_AIFI_LAYER = re.compile(r'^(?:aifi|encoder)\.(\d+)\.layers\.(\d+)\.')
#: Inside an AIFI layer, both spellings -> ours; first match wins.
_AIFI_RENAMES = ((r'^self_attn\.(?:o|out)_proj\.', 'out_proj.'), (r'^self_attn\.', ''),
                 (r'^self_attn_layer_norm\.', 'norm1.'), (r'^(?:mlp\.layers\.0|fc1)\.', 'fc1.'),
                 (r'^(?:mlp\.layers\.1|fc2)\.', 'fc2.'), (r'^final_layer_norm\.', 'norm2.'))
#: transformers' DINOv3 LayerScale (``layer.{i}.layer_scale{1,2}.lambda1``).
_LAYER_SCALE = re.compile(r'\.layer_scale[12]\.lambda1$')
_BLOCK = r'^((?:fpn|pan)_blocks\.\d+\.|fpn_block\.|pan_block\.)'
#: D-FINE's RepNCSPELAN4 names -> ours.
_ELAN4_RENAMES = ((_BLOCK + r'conv1\.', r'\1conv_in.'),
                  (_BLOCK + r'csp_rep1\.', r'\1branches.0.csp.'),
                  (_BLOCK + r'conv2\.', r'\1branches.0.conv.'),
                  (_BLOCK + r'csp_rep2\.', r'\1branches.1.csp.'),
                  (_BLOCK + r'conv3\.', r'\1branches.1.conv.'),
                  (_BLOCK + r'conv4\.', r'\1conv_out.'))
#: DEIMv2's RepNCSPELAN5 names (its CSP layers hold the branch conv as ``conv2``) -> ours.
_ELAN5_RENAMES = ((_BLOCK + r'conv1\.', r'\1conv_in.'), (_BLOCK + r'conv2\.', r'\1conv_out.'),
                  (_BLOCK + r'csp_rep1\.conv2\.', r'\1branches.0.conv.'),
                  (_BLOCK + r'csp_rep2\.conv2\.', r'\1branches.1.conv.'),
                  (_BLOCK + r'csp_rep1\.', r'\1branches.0.csp.'),
                  (_BLOCK + r'csp_rep2\.', r'\1branches.1.csp.'))

#: DEIMv2's lite encoder names -> ours.
_LITE_RENAMES = ((r'^down_conv([12])\.', r'down\1.conv.'), (r'^bi_fusion_conv\.', 'gap_fusion.'))


def _rename(key: str, renames: Sequence[Tuple[str, str]], first_only: bool = False) -> str:
    for pattern, repl in renames:
        key, n = re.subn(pattern, repl, key)
        if n and first_only:
            break
    return key


@dataclasses.dataclass(frozen=True)
class PartsLayout(Layout):
    """A layout several of our modules load a part of (a detector's backbone, its encoder)."""

    parts: Tuple[str, ...] = ()

    def loads_into(self, family: str) -> bool:
        return family == self.family or family in self.parts


def _model_prefix(sd: Mapping[str, Tensor], key: str) -> Optional[str]:
    """``'model.'`` or ``''``: where ``key`` sits in ``sd``; None when absent."""
    return next((p for p in ('model.', '') if p + key in sd), None)


def deimv2_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout name of a D-FINE / DEIMv2 / HGNetV2 state dict, or None."""
    for name, (_, key, _) in _DETECTORS.items():
        if _model_prefix(sd, key) is not None:
            return name
    if 'embedder.stem1.convolution.weight' in sd and any(
            k.startswith('encoder.stages.') for k in sd):
        return _TRANSFORMERS_HGNETV2
    if any(k in sd for k in (_OFFICIAL_STEM, 'backbone.' + _OFFICIAL_STEM)):
        return _OFFICIAL_HGNETV2
    return None


def _under(sd: Mapping[str, Tensor], prefix: str) -> StateDict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def hgnetv2_part(sd: Mapping[str, Tensor], name: str) -> StateDict:
    """The HGNetV2 of a layout-``name`` state dict (its model prefix removed) in our names."""
    if name == _OFFICIAL_HGNETV2:
        inner = _under(sd, 'backbone.') if 'backbone.' + _OFFICIAL_STEM in sd else dict(sd)
        return {k: v for k, v in inner.items() if k.startswith(('stem.', 'stages.'))}
    part = _under(sd, _HGNETV2_PREFIX[name])
    return {_rename(k, _HGNETV2_RENAMES): v for k, v in part.items()
            if k.startswith(('embedder.', 'encoder.stages.'))}


def encoder_part(sd: Mapping[str, Tensor], name: str) -> StateDict:
    """The hybrid / lite encoder of a detector state dict (its model prefix removed) in our
    names: its input projections and ``encoder.*``."""
    out = {}
    if name in _INPUT_PROJ:
        pattern, parts = _INPUT_PROJ[name]
        for k, v in sd.items():
            m = pattern.match(k)
            if m:
                out[f'input_proj.{m.group(1)}.{parts[m.group(2)]}.{k[m.end():]}'] = v
    renames = (_ELAN4_RENAMES if name == 'transformers DFine'
               else _ELAN5_RENAMES + _LITE_RENAMES)
    for k, v in _under(sd, 'encoder.').items():
        m = _AIFI_LAYER.match(k)
        if m:
            key = f'aifi.{m.group(1)}.{m.group(2)}.' + _rename(k[m.end():], _AIFI_RENAMES, True)
        else:
            key = _rename(k, renames, first_only=True)
        out[key] = v
    return out


def sta_part(sd: Mapping[str, Tensor], target: CheckpointTarget,
             resampled: Optional[List[str]]) -> Tuple[StateDict, List[str]]:
    """DEIMv2's DINOv3 backbone, adapter and fusion projections in our names (``vit.*``
    through the transformers DINOv3 layout, ``sta.*``, ``fusion_proj.*``)."""
    vit_sd = _under(sd, 'conv_encoder.backbone.')
    expected = target.expected or {}
    vit_expected = {k[len('vit.'):]: s for k, s in expected.items() if k.startswith('vit.')}
    vit_target = dataclasses.replace(target, family='DINOv3', expected=vit_expected)
    scales = [] if 'blocks.0.ls1.gamma' in vit_expected else \
        [k for k in vit_sd if _LAYER_SCALE.search(k)]
    for k in scales:  # DEIMv2's ViT-Tiny has none: transformers adds them at 1
        if not torch.all(vit_sd[k] == 1):
            raise CheckpointError(
                f'the checkpoint\'s ViT has LayerScale ({k} is not 1) and {target.owner}\'s '
                'has none: build it with vit=dict(..., layer_scale=1.0)')
        vit_sd.pop(k)
    dinov3 = next(layout for layout in TRANSFORMERS_LAYOUTS
                  if layout.name == 'transformers DINOv3ViTModel')
    vit, dropped = dinov3.convert(vit_sd, vit_target, resampled)
    dropped += scales
    for k in [k for k in vit if k.endswith('.attn.q_bias')]:
        base = k[:-len('q_bias')]
        if base + 'qkv.bias' in vit_expected:  # a q / k / v-biased ViT: a zero k bias
            q, v = vit.pop(k), vit.pop(base + 'v_bias')
            vit[base + 'qkv.bias'] = torch.cat([q, torch.zeros_like(q), v])
    out = {'vit.' + k: v for k, v in vit.items()}
    out.update({'sta.' + k: v for k, v in
                _under(sd, 'conv_encoder.spatial_tuning_adapter.').items()})
    out.update({'fusion_proj.' + k: v for k, v in _under(sd, 'conv_encoder.fusion_proj.').items()})
    return out, ['conv_encoder.backbone.' + k for k in dropped]


def _with_bn_counters(sd: StateDict, expected: Mapping[str, torch.Size]) -> StateDict:
    """``sd`` with a zero ``num_batches_tracked`` for every BatchNorm of ours it lacks (frozen
    BatchNorms keep none)."""
    out = dict(sd)
    for k in expected:
        if k.endswith('.num_batches_tracked') and k not in out \
                and k[:-len('num_batches_tracked')] + 'running_mean' in out:
            out[k] = torch.zeros((), dtype=torch.long)
    return out


def convert_deimv2_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                          resampled: Optional[List[str]] = None
                          ) -> Tuple[StateDict, List[str]]:
    """The table's D-FINE / DEIMv2 converter: the part ``target.family`` names."""
    name = layout.name
    prefix = ''
    if name in _DETECTORS:
        prefix = _model_prefix(sd, _DETECTORS[name][1]) or ''
    inner = _under(sd, prefix)
    dropped: List[str] = []
    extra_stages = 0
    if target.family == HGNETV2:
        part = hgnetv2_part(inner, name)
        extra_stages = _stage_count(part) - _stage_count(target.expected or part)
        if extra_stages > 0:  # DEIMv2's 3-stage sizes start from B0's weights
            part = {k: v for k, v in part.items()
                    if _stage(k) < _stage_count(target.expected or part)}
    elif target.family in (HYBRID, LITE) and name in _DETECTORS:
        part = encoder_part(inner, name)
        kind = LITE if any(k.startswith('fpn_block.') for k in part) else HYBRID
        if kind != target.family:
            raise CheckpointError(f'{layout.describe()} holds a {kind} (its encoder keys), not '
                                  f"a {target.family}: build type='{FAMILY_MODULES[kind]}'")
    elif target.family == DINOV3_STA and name in _DETECTORS:
        part, dropped = sta_part(inner, target, resampled)
        dropped = [prefix + k for k in dropped]
    else:
        raise CheckpointError(f'{layout.describe()} holds no {target.family} weights for '
                              f'{target.owner}: load it into '
                              f"{' / '.join(FAMILY_MODULES[p] for p in _parts(layout))}")
    if target.expected is not None:
        part = _with_bn_counters(part, target.expected)
    used = set(_source_keys(inner, prefix, target.family, name))
    if extra_stages > 0:
        kept = _stage_count(target.expected or part)
        used = {k for k in used if _stage(k) < kept}
    dropped += [k for k in sd if k not in used and k not in dropped]
    return part, dropped


_STAGE = re.compile(r'(?:^|\.)stages\.(\d+)\.')


def _stage(key: str) -> int:
    """The HGNetV2 stage a key belongs to (-1: the stem)."""
    m = _STAGE.search(key)
    return int(m.group(1)) if m else -1


def _stage_count(keys: Mapping[str, object]) -> int:
    return 1 + max((_stage(k) for k in keys), default=-1)


def _parts(layout: Layout) -> Tuple[str, ...]:
    return layout.parts if isinstance(layout, PartsLayout) else (layout.family,)


def _source_keys(inner: Mapping[str, Tensor], prefix: str, family: str,
                 name: str) -> List[str]:
    """The checkpoint keys a part was read from (the rest is reported as dropped)."""
    hg = _HGNETV2_PREFIX.get(name, '')
    roots: Dict[str, Tuple[str, ...]] = {
        HGNETV2: (hg + 'embedder.', hg + 'encoder.stages.') if name != _OFFICIAL_HGNETV2
        else ('stem.', 'stages.', 'backbone.stem.', 'backbone.stages.'),
        HYBRID: ('encoder.', 'encoder_input_proj.', 'conv_encoder.encoder_input_proj.'),
        LITE: ('encoder.',),
        DINOV3_STA: ('conv_encoder.spatial_tuning_adapter.', 'conv_encoder.fusion_proj.',
                     'conv_encoder.backbone.')}
    return [prefix + k for k in inner if k.startswith(roots[family])]


#: The layouts of this module.
LAYOUTS: Tuple[Layout, ...] = tuple(
    PartsLayout(family, name, deimv2_layout, convert_deimv2_layout, CLASS_NAMED,
                parts=parts) for name, (family, _, parts) in _DETECTORS.items()) + (
    Layout(HGNETV2, _TRANSFORMERS_HGNETV2, deimv2_layout, convert_deimv2_layout, CLASS_NAMED),
    Layout(HGNETV2, _OFFICIAL_HGNETV2, deimv2_layout, convert_deimv2_layout, SPECIFIC))
