"""A whole transformers D-FINE / DEIMv2 detector -> our detector's state dict.

``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` (``save_pretrained`` folders, keys
under ``model.``) map onto mmdet's ``SingleStageDetector(backbone, neck, bbox_head=DFineHead)``:

* ``backbone.``: ``HGNetV2Backbone`` or ``DINOv3STABackbone`` through :mod:`.deimv2`'s layouts;
* ``neck.``: ``HybridEncoder`` / ``LiteEncoder`` (with its input projections), the same;
* ``bbox_head.``: the decoder, query selection and denoising embedding through
  :func:`~.dfine_keys.dfine_head_state_dict`, and transformers' ``decoder_input_proj`` as the
  head's ``input_proj`` (``{i}.0`` / ``{i}.1`` or ``{i}.conv`` / ``{i}.norm`` -> ``{i}.conv`` /
  ``{i}.norm``).

:func:`dfine_to_detector` is a pure function of the state dict and the detector's expected
``{name: shape}`` (the parts' converters need the model's shapes: an HGNetV2 of fewer stages,
a ViT without LayerScale); every tensor is accounted for (loaded, or one of the known copies
and constants: the top-level ``class_embed`` / ``bbox_embed``, the decoder's ``up`` /
``reg_scale`` checked against the head).
"""
import re
from typing import Dict, List, Mapping, Optional, Tuple

from torch import Size, Tensor

from ..functional.checkpoint_target import CheckpointTarget
from . import deimv2
from .checkpoint_io import CheckpointError
from .common import StateDict, check_state_dict
from .dfine_keys import DECODER_PREFIX, check_bins, dfine_head_state_dict

#: The detector's parts: (prefix in our detector, families its module may load).
PARTS = (('backbone.', (deimv2.HGNETV2, deimv2.DINOV3_STA)),
         ('neck.', (deimv2.HYBRID, deimv2.LITE)))
#: transformers' ``decoder_input_proj`` (D-FINE: ``{i}.0`` / ``{i}.1``, DEIMv2: ``conv`` /
#: ``norm``).
_INPUT_PROJ = re.compile(r'^model\.decoder_input_proj\.(\d+)\.(0|1|conv|norm)\.')
_PROJ_NAMES = {'0': 'conv', '1': 'norm', 'conv': 'conv', 'norm': 'norm'}
#: Tensors not loaded: transformers' copies of the decoder's branches, its constants (the
#: head builds them from its arguments), DINOv3's pretraining mask token, and what the DINOv3
#: layout drops once checked (an empty register tensor, a LayerScale of 1 on a ViT without)
#: and the final norm of a ViT whose taps take none (DEIMv2 S / M).
_NOT_LOADED = re.compile(r'^(?:class_embed|bbox_embed)\.|^model\.decoder\.(?:up|reg_scale)$|'
                         r'\.num_points_scale$|^model\.conv_encoder\.backbone\.embeddings\.'
                         r'(?:mask_token|register_tokens)$|\.layer_scale[12]\.lambda1$|'
                         r'^model\.conv_encoder\.backbone\.norm\.')


#: ``save_pretrained``'s spellings of D-FINE decoder layers (transformers' checkpoint
#: conversion mapping) -> the in-memory names :mod:`.dfine_keys` reads.
_DISK_NAMES = ((r'^(model\.decoder\.layers\.\d+\.)fc([12])\.',
                lambda m: f'{m.group(1)}mlp.layers.{int(m.group(2)) - 1}.'),
               (r'^(model\.decoder\.layers\.\d+\.self_attn\.)out_proj\.', r'\1o_proj.'))


def _in_memory_names(sd: Mapping[str, Tensor]) -> Dict[str, str]:
    """``{in-memory name: checkpoint name}`` of the decoder keys (other keys unchanged)."""
    out = {}
    for key in sd:
        new = key
        for pattern, repl in _DISK_NAMES:
            new = re.sub(pattern, repl, new)
        out[new] = key
    return out


def dfine_detector_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The :mod:`.deimv2` detector layout of a whole transformers detector state dict (keys
    under ``model.`` with its decoder), or None."""
    name = deimv2.deimv2_layout(sd)
    if name not in deimv2._DETECTORS or not any(k.startswith(DECODER_PREFIX) for k in sd):
        return None
    return name


def _family(sd: Mapping[str, Tensor], families: Tuple[str, ...]) -> str:
    """Which of ``families`` a detector checkpoint's part is (by its keys)."""
    markers = {deimv2.DINOV3_STA: 'model.conv_encoder.spatial_tuning_adapter.',
               deimv2.LITE: 'model.encoder.fpn_block.'}
    for family in families:
        if family in markers and any(k.startswith(markers[family]) for k in sd):
            return family
    return families[0]


def dfine_to_detector(sd: Mapping[str, Tensor], expected: Optional[Mapping[str, Size]],
                      owner: str = 'the detector',
                      bins: Optional[Tuple[float, float]] = None) -> Tuple[StateDict, List[str]]:
    """A transformers D-FINE / DEIMv2 detector state dict in our detector's names, checked
    strictly against ``expected`` (the detector's ``{name: shape}``); also the checkpoint keys
    not loaded (the known copies and constants). A :class:`CheckpointError` names what does
    not fit and the fix. ``expected=None`` converts names only (``tools/convert_weights.py``):
    an HGNetV2 detector as saved; a DINOv3 one is refused (its ViT's LayerScale and k bias
    follow the model). ``bins``: the head's ``(up, reg_scale)``, which must be the
    checkpoint's (they set the distribution bins)."""
    name = dfine_detector_layout(sd)
    if name is None:
        raise CheckpointError(
            f'not a transformers DFineForObjectDetection / Deimv2ForObjectDetection state dict '
            f'(first keys: {list(sd)[:3]}): give a save_pretrained folder of one of them; a '
            'backbone-only checkpoint loads through the backbone\'s own init_cfg')
    layout = next(lay for lay in deimv2.LAYOUTS if lay.name == name)
    if expected is None and layout.family == deimv2.DEIMV2_DINOV3:
        raise CheckpointError(
            f'{layout.describe()}: its DINOv3 converts for a given model (LayerScale, k bias): '
            "load the folder with the detector's init_cfg=dict(type='Pretrained', "
            'checkpoint=FOLDER) in its config, or save that model\'s state_dict')
    out: StateDict = {}
    used = set()
    for prefix, families in PARTS:
        part_expected = (None if expected is None else
                         {k[len(prefix):]: s for k, s in expected.items() if k.startswith(prefix)})
        family = _family(sd, families)
        target = CheckpointTarget(family=family, owner=f'{owner} ({prefix[:-1]})',
                                  expected=part_expected)
        part, dropped = deimv2.convert_deimv2_layout(dict(sd), layout, target)
        out.update({prefix + k: v for k, v in part.items()})
        used |= set(sd) - set(dropped)
    if bins is not None:
        check_bins(sd, *bins)
    names = _in_memory_names(sd)
    head = dfine_head_state_dict({new: sd[old] for new, old in names.items()})
    used |= {k for k in sd if k.startswith(('model.decoder.', 'model.enc_', 'model.weight_emb',
                                            'model.denoising_class_embed.'))}
    out.update({'bbox_head.' + k: v for k, v in head.items()})
    for k, v in sd.items():
        m = _INPUT_PROJ.match(k)
        if m:
            out[f'bbox_head.input_proj.{m.group(1)}.{_PROJ_NAMES[m.group(2)]}.{k[m.end():]}'] = v
            used.add(k)
    if expected is not None:
        out = deimv2._with_bn_counters(out, expected)
    left = [k for k in sd if k not in used]
    unknown = [k for k in left if not _NOT_LOADED.search(k)]
    if unknown:
        raise CheckpointError(f'{len(unknown)} tensors of the {name} checkpoint belong to no '
                              f'part of {owner} (e.g. {unknown[:3]}): is it a detector of this '
                              'family (DFineForObjectDetection / Deimv2ForObjectDetection)?')
    if expected is not None:
        check_state_dict(out, expected, source=f'{name} checkpoint', owner=owner, dropped=left)
    return out, left

