"""RF-DETR checkpoints (the ``rfdetr`` package's ``.pth``: ``{'model': state_dict, 'args':
...}``) -> our detector (``backbone.`` :class:`DINOv2Backbone`, ``neck.`` RFDETRProjector,
``bbox_head.`` LWDETRHead; RF-DETR-Seg's: LWDETRSegHead), or its backbone part alone ->
``DINOv2Backbone``.

Pure ``state_dict -> state_dict`` functions, one layout of the table (:data:`LAYOUTS`),
detected by RF-DETR's projector (``backbone.0.projector.``) and decoder
(``transformer.decoder.``) keys:

* the backbone (``backbone.0.encoder.encoder.*``, transformers' DINOv2 names) through the
  transformers DINOv2 layout (:mod:`.transformers_layouts`); the projector through
  :func:`~.rfdetr_keys.rfdetr_projector_state_dict`; the head through
  :func:`~.lwdetr_keys.rfdetr_head_state_dict`; RF-DETR-Seg's mask head through
  :func:`~.lwdetr_seg_keys.split_mask_branch`;
* the classifier (:mod:`.rfdetr_classes`): a head of the file's own classes takes them as
  rfdetr's ``predict`` names them (a COCO file's 91 logits as mmdet's 80 COCO classes, a
  fine-tuned file's ``K + 1`` logits as its ``K`` classes, the no-object slot dropped); a head
  fine-tuned from the file on other classes starts from rfdetr's re-initialised rows; any other
  count is refused naming ``num_classes``;
* a checkpoint of another size than the model (patch, position grid, decoder layers, widths,
  queries) is refused naming the config of ``configs/rfdetr/`` that builds it
  (:data:`RFDETR_CONFIGS`), for the whole detector and for the backbone part alone; so is a
  seg checkpoint for a head without a mask branch, or a detection checkpoint for one with it.

mmengine's loaders (``load_from``, ``tools/test.py``, a detector's ``init_cfg``) read an
RF-DETR file as our detector's checkpoint (:func:`as_detector_checkpoint`); the model-aware
check of what they load is :mod:`.model_load`'s.

The files are read by :mod:`.checkpoint_io` (``weights_only``, RF-DETR's ``args`` namespace
allowed for that read only); a Lightning copy (``state_dict`` keys under ``model.``) reads
the same.
"""
import math
import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional.checkpoint_target import CheckpointTarget
from .checkpoint_io import CheckpointError
from .common import StateDict, select_prefix
from .layout import CLASS_NAMED, Layout, layouts_of
from .lwdetr_keys import rfdetr_head_state_dict
from .lwdetr_seg_keys import OUR_PREFIX as MASK_BRANCH_PREFIX
from .lwdetr_seg_keys import SEG_PREFIX as RFDETR_SEG_PREFIX
from .lwdetr_seg_keys import split_mask_branch
from .rfdetr_classes import (FileClasses, args_class_names, class_entries, file_classes,
                             finetune_rows, own_rows, select_rows, transformers_labels)
from .rfdetr_keys import RFDETR_PROJECTOR_PREFIX, rfdetr_projector_state_dict
from .transformers_layouts import LAYOUTS as TRANSFORMERS_LAYOUTS
from .transformers_layouts import transformers_layout

#: The family of RF-DETR's checkpoints, its layout and the family of its backbone part.
RFDETR = 'RF-DETR'
RFDETR_LAYOUT = 'rfdetr'
BACKBONE_FAMILY = 'DINOv2'
#: Where RF-DETR keeps its ViT (transformers ``Dinov2Model`` / ``Dinov2WithRegistersModel``).
RFDETR_BACKBONE_PREFIX = 'backbone.0.encoder.encoder.'
RFDETR_DECODER_PREFIX = 'transformer.decoder.'
#: A Lightning checkpoint's copy of the model (its ``state_dict``).
LIGHTNING_PREFIX = 'model.'
#: Our detector's parts (mmdet's ``SingleStageDetector``).
BACKBONE, NECK, HEAD = 'backbone.', 'neck.', 'bbox_head.'
#: LWDETRSegHead's mask branch, in our detector's names.
MASK_BRANCH = HEAD + MASK_BRANCH_PREFIX

_DECODER_LAYER = re.compile(r'^bbox_head\.decoder\.layers\.(\d+)\.')
#: Shapes the size of an RF-DETR is read from, in our detector's names.
_PATCH = BACKBONE + 'patch_embed.proj.weight'
_POS = BACKBONE + 'pos_embed'
_TAPS = NECK + 'fusions.0.conv_in.conv.weight'
_HIDDEN = HEAD + 'decoder.norm.weight'
_QUERIES = HEAD + 'query_feat.weight'
_CLASSES = HEAD + 'cls_branch.bias'


class RFDETRConfig(NamedTuple):
    """A config of ``configs/rfdetr/``, the rfdetr model it builds and that model's size."""
    config: str
    name: str
    patch: int
    grid: int
    layers: int
    seg: bool


#: The configs of ``configs/rfdetr/`` (rfdetr's ``config.py`` sizes: patch, position grid =
#: resolution / patch, decoder layers).
RFDETR_CONFIGS: Tuple[RFDETRConfig, ...] = (
    RFDETRConfig('rfdetr_nano.py', 'RF-DETR N', 16, 24, 2, False),
    RFDETRConfig('rfdetr_small.py', 'RF-DETR S', 16, 32, 3, False),
    RFDETRConfig('rfdetr_medium.py', 'RF-DETR M', 16, 36, 4, False),
    RFDETRConfig('rfdetr_large.py', 'RF-DETR L', 16, 44, 4, False),
    RFDETRConfig('rfdetr_seg_nano.py', 'RF-DETR-Seg N', 12, 26, 4, True),
    RFDETRConfig('rfdetr_seg_small.py', 'RF-DETR-Seg S', 12, 32, 4, True),
    RFDETRConfig('rfdetr_seg_medium.py', 'RF-DETR-Seg M', 12, 36, 5, True),
    RFDETRConfig('rfdetr_seg_large.py', 'RF-DETR-Seg L', 12, 42, 5, True),
    RFDETRConfig('rfdetr_seg_xlarge.py', 'RF-DETR-Seg XL', 12, 52, 6, True),
    RFDETRConfig('rfdetr_seg_2xlarge.py', 'RF-DETR-Seg 2XL', 12, 64, 6, True),
)
#: The patch of RF-DETR's detection sizes (a grid's image size when the patch is not known).
PATCH_OF_RFDETR = 16
#: How each size field reads in messages, and the config argument that sets it.
_FIELDS = {'patch': ('patch {}', 'model.backbone.patch_size={}'),
           'grid': ('position grid {0}x{0}',
                    'model.backbone.pretrain_img_size={}, pretrain_patch_size={}'),
           'width': ('ViT width {}', "model.backbone.arch='small' (embed_dims={})"),
           'taps': ('{} projector input channels', 'model.neck.in_channels (total {})'),
           'layers': ('{} decoder layers', 'model.bbox_head.num_decoder_layers={}'),
           'hidden': ('decoder width {}', 'model.bbox_head.embed_dims={}'),
           'queries': ('{} query rows (queries x groups)',
                       'model.bbox_head.num_queries x num_groups={}')}


def model_state(sd: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """RF-DETR's ``model`` state dict: ``sd`` itself, or a Lightning copy un-prefixed."""
    if sd and all(k.startswith(LIGHTNING_PREFIX) for k in sd):
        return select_prefix(sd, LIGHTNING_PREFIX)
    return sd


def rfdetr_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """:data:`RFDETR_LAYOUT` when ``sd`` is an RF-DETR model's state dict, else None."""
    keys = list(model_state(sd))
    found = (any(k.startswith(RFDETR_PROJECTOR_PREFIX) for k in keys)
             and any(k.startswith(RFDETR_DECODER_PREFIX) for k in keys))
    return RFDETR_LAYOUT if found else None


def read_size(shapes: Mapping[str, Sequence[int]]) -> Dict[str, int]:
    """The size fields (:data:`_FIELDS`) of our detector's ``{name: shape}`` (a converted
    checkpoint or a model's), those it has the keys of."""
    size: Dict[str, int] = {}
    if _PATCH in shapes:
        size['patch'] = int(shapes[_PATCH][-1])
        size['width'] = int(shapes[_PATCH][0])
    if _POS in shapes:
        size['grid'] = math.isqrt(int(shapes[_POS][1]) - 1)
    if _TAPS in shapes:
        size['taps'] = int(shapes[_TAPS][1])
    layers = {int(m[1]) for m in map(_DECODER_LAYER.match, shapes) if m}
    if layers:
        size['layers'] = max(layers) + 1
    if _HIDDEN in shapes:
        size['hidden'] = int(shapes[_HIDDEN][0])
    if _QUERIES in shapes:
        size['queries'] = int(shapes[_QUERIES][0])
    return size


def matching_configs(size: Mapping[str, int], seg: bool
                     ) -> Tuple[List[RFDETRConfig], List[RFDETRConfig]]:
    """The configs of :data:`RFDETR_CONFIGS` that build an RF-DETR of ``size``: those that
    match every field, and those of the same patch, decoder layers and head (any grid)."""
    near = [c for c in RFDETR_CONFIGS
            if c.seg == seg and c.patch == size.get('patch', c.patch)
            and c.layers == size.get('layers', c.layers)]
    return [c for c in near if c.grid == size.get('grid', c.grid)], near


def config_fix(size: Mapping[str, int], seg: bool = False) -> str:
    """What builds an RF-DETR of ``size``: its config, or the nearest with the position grid
    set, or (no config near) the arguments."""
    exact, near = matching_configs(size, seg)
    names = ' or '.join(f'configs/rfdetr/{c.config}' for c in exact or near)
    if exact:
        return f'build it from {names}'
    if near:
        grid = f" with {_argument('grid', size)}" if 'grid' in size else ''
        return f'build it from {names}{grid}'
    return f"build it with {', '.join(_argument(k, size) for k in size)}"


def _argument(field: str, size: Mapping[str, int]) -> str:
    """The config argument that sets ``field`` of ``size`` (the grid: as image / patch)."""
    if field == 'grid':
        patch = size.get('patch', PATCH_OF_RFDETR)
        return _FIELDS[field][1].format(size[field] * patch, patch)
    return _FIELDS[field][1].format(size[field])


def size_name(size: Mapping[str, int], seg: bool = False) -> str:
    """``an RF-DETR S`` when ``size`` is exactly one config's, else ``an RF-DETR``."""
    exact, _ = matching_configs(size, seg)
    return f'an {exact[0].name}' if len(exact) == 1 else f"an RF-DETR{'-Seg' if seg else ''}"


def _describe(size: Mapping[str, int], patch: Optional[int] = None) -> str:
    """The fields of ``size`` as a message reads them; the grid with its image size (of
    ``size``'s patch, else ``patch``)."""
    patch = size.get('patch', patch)
    parts = []
    for k, v in size.items():
        text = _FIELDS[k][0].format(v)
        if k == 'grid' and patch:
            text += f' ({v * patch} px)'
        parts.append(text)
    return ', '.join(parts)


def size_refusal(have: Mapping[str, int], want: Mapping[str, int], owner: str,
                 seg: bool = False) -> Optional[str]:
    """The message refusing an RF-DETR checkpoint of size ``have`` for a model of ``want``
    (naming the config that builds the checkpoint), or None when every field both have
    agrees."""
    diff = [k for k in have if k in want and have[k] != want[k]]
    if not diff:
        return None
    return (f'the checkpoint is {size_name(have, seg)} of {_describe(have)}; {owner} was built '
            f"with {_describe({k: want[k] for k in diff}, want.get('patch'))}: "
            f'{config_fix(have, seg)}')


def is_rfdetr_detector(names: Iterable[str]) -> bool:
    """Whether our detector's ``names`` are an RF-DETR's (RFDETRProjector and LWDETRHead)."""
    names = set(names)
    return _TAPS in names and _QUERIES in names


def has_mask_branch(names: Iterable[str]) -> bool:
    """Whether our detector's ``names`` (a converted checkpoint's or a model's) hold
    LWDETRSegHead's mask branch."""
    return any(k.startswith(MASK_BRANCH) for k in names)


def check_task(sd: Mapping[str, Tensor], seg: bool, expected: Mapping[str, Sequence[int]],
               owner: str) -> None:
    """Refuse an RF-DETR-Seg checkpoint (``seg``) for a head without a mask branch, or a
    detection checkpoint for one with it (a model without head keys takes either), naming
    the config that builds the checkpoint."""
    if not any(k.startswith(HEAD) for k in expected) or has_mask_branch(expected) == seg:
        return
    fix = config_fix(_checkpoint_size(sd), seg)
    if seg:
        raise CheckpointError(
            f'the checkpoint is an RF-DETR-Seg ({RFDETR_SEG_PREFIX}* keys); the head of {owner} '
            f"has no mask branch (LWDETRHead): {fix}, or load the checkpoint's backbone alone "
            "(the backbone's init_cfg type='Pretrained')")
    raise CheckpointError(
        f'the checkpoint is an RF-DETR detector (no {RFDETR_SEG_PREFIX}* keys); the head of '
        f"{owner} has a mask branch (LWDETRSegHead): {fix}, or load the checkpoint's backbone "
        "alone (the backbone's init_cfg type='Pretrained')")


def check_size(converted: Mapping[str, Tensor], expected: Mapping[str, Sequence[int]],
               owner: str, seg: bool = False) -> None:
    """Refuse (naming the config that builds the checkpoint) a converted RF-DETR checkpoint
    whose size differs from the model's on any field both have."""
    refusal = size_refusal(read_size({k: v.shape for k, v in converted.items()}),
                           read_size(expected), owner, seg)
    if refusal:
        raise CheckpointError(refusal)


def map_classes(head: StateDict, num_classes: Optional[int], owner: str,
                names: Optional[Sequence[str]] = None, finetune: bool = False) -> StateDict:
    """``head`` (our LWDETRHead keys, the checkpoint's classifier as saved; ``names``: rfdetr's
    class names from its ``args``) for a head of ``num_classes``. None or the file's own
    classes: rfdetr's label space (:func:`~.rfdetr_classes.own_rows`: COCO's 80, or the
    fine-tuned ``K`` without the no-object slot); the saved logits: as saved. Any other count
    is refused naming ``num_classes``, but with ``finetune`` (a head of classes of your own
    starting from the file) it gets rfdetr's re-initialised rows
    (:func:`~.rfdetr_classes.finetune_rows`)."""
    classes = file_classes(int(head['cls_branch.bias'].shape[0]), names)
    if num_classes == classes.logits:
        return head
    if num_classes is None or num_classes == classes.own:
        return select_rows(head, own_rows(classes))
    if finetune:
        return select_rows(head, finetune_rows(classes.logits, num_classes))
    raise CheckpointError(class_refusal(classes, num_classes, owner))


def class_refusal(classes: FileClasses, num_classes: int, owner: str) -> str:
    """The message refusing a checkpoint of ``classes`` for a head of ``num_classes``."""
    return (f"the checkpoint's classifier has {classes.describe()}; the head of {owner} was "
            f'built with num_classes={num_classes}: build it with num_classes={classes.own} '
            f'(--cfg-options model.bbox_head.num_classes={classes.own}), or, to fine-tune a head '
            "of other classes from it, give it as the detector's init_cfg=dict(type="
            "'Pretrained', checkpoint=...) (configs/rfdetr/rfdetr_nano_finetune_custom.py): "
            "the class branches start as rfdetr's reinitialize_detection_head sets them")


def rfdetr_backbone(sd: Mapping[str, Tensor], target: CheckpointTarget,
                    resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """The ViT of an RF-DETR state dict converted for a DINOv2 ``target`` (through the
    transformers DINOv2 layout), and the keys dropped (RF-DETR's projector and head too)."""
    sd = model_state(sd)
    vit = select_prefix({k: v for k, v in sd.items() if k.startswith(RFDETR_BACKBONE_PREFIX)},
                        RFDETR_BACKBONE_PREFIX)
    name = transformers_layout(vit)
    layout = next((lay for lay in TRANSFORMERS_LAYOUTS if lay.name == name), None)
    if layout is None:
        raise CheckpointError(f'the RF-DETR checkpoint has no DINOv2 under '
                              f'{RFDETR_BACKBONE_PREFIX!r}; first keys: {list(sd)[:5]}')
    converted, dropped = layout.convert(vit, target, resampled)
    others = [k for k in sd if not k.startswith(RFDETR_BACKBONE_PREFIX)]
    return converted, [RFDETR_BACKBONE_PREFIX + k for k in dropped] + others


def rfdetr_to_detector(sd: Mapping[str, Tensor],
                       expected: Optional[Mapping[str, Sequence[int]]] = None,
                       owner: str = 'the detector', num_classes: Optional[int] = None,
                       resampled: Optional[List[str]] = None,
                       names: Optional[Sequence[str]] = None, finetune: bool = False,
                       as_saved: bool = False) -> Tuple[StateDict, List[str]]:
    """An RF-DETR state dict -> our detector's (``backbone.`` / ``neck.`` / ``bbox_head.``)
    and the dropped keys. ``expected``: the detector's ``{name: shape}`` (or a part of it):
    its task (:func:`check_task`) and size (:func:`check_size`) are checked and its head's
    classes chosen (:func:`map_classes` with rfdetr's class ``names`` and ``finetune``;
    ``num_classes`` when it has no head); ``as_saved``: the classifier as the file has it."""
    sd = model_state(sd)
    seg = any(k.startswith(RFDETR_SEG_PREFIX) for k in sd)
    expected = expected or {}
    check_task(sd, seg, expected, owner)
    inner = {k[len(BACKBONE):]: torch.Size(s) for k, s in expected.items()
             if k.startswith(BACKBONE)}
    backbone, dropped = rfdetr_backbone(
        sd, CheckpointTarget(BACKBONE_FAMILY, owner, inner or None), resampled)
    dropped = [k for k in dropped if k.startswith(RFDETR_BACKBONE_PREFIX)]
    neck = rfdetr_projector_state_dict(sd)
    rest = {k: v for k, v in sd.items() if not k.startswith('backbone.')}
    try:
        rest, mask_branch = split_mask_branch(rest)
        head = rfdetr_head_state_dict(rest)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f'{e.args[0]}') from e
    converted = {**{BACKBONE + k: v for k, v in backbone.items()},
                 **{NECK + k: v for k, v in neck.items()}}
    check_size({**converted, **{HEAD + k: v for k, v in head.items()}}, expected, owner, seg)
    classes = int(expected[_CLASSES][0]) if _CLASSES in expected else num_classes
    if not as_saved:
        head = map_classes(head, classes, owner, names, finetune)
    head.update(mask_branch)
    converted.update({HEAD + k: v for k, v in head.items()})
    return converted, dropped


def _checkpoint_size(sd: Mapping[str, Tensor]) -> Dict[str, int]:
    """The patch, grid and decoder layers of an RF-DETR state dict, read as converted."""
    vit = select_prefix({k: v for k, v in sd.items() if k.startswith(RFDETR_BACKBONE_PREFIX)},
                        RFDETR_BACKBONE_PREFIX)
    shapes: Dict[str, Sequence[int]] = {}
    kernel = vit.get('embeddings.patch_embeddings.projection.weight')
    pos = vit.get('embeddings.position_embeddings')
    if kernel is not None:
        shapes[_PATCH] = kernel.shape
    if pos is not None:
        shapes[_POS] = pos.shape
    for k in sd:
        if k.startswith(RFDETR_DECODER_PREFIX + 'layers.'):
            shapes[HEAD + 'decoder.' + k[len(RFDETR_DECODER_PREFIX):]] = ()
    return read_size(shapes)


def convert_rfdetr_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                          resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """The table's RF-DETR converter: the whole detector for an :data:`RFDETR` target, the
    backbone part alone for a DINOv2 one (the rest dropped, reported)."""
    del layout  # one layout
    if target.family == BACKBONE_FAMILY:
        check_backbone_size(model_state(sd), target)
        return rfdetr_backbone(sd, target, resampled)
    return rfdetr_to_detector(sd, target.expected, target.owner, resampled=resampled)


def check_backbone_size(sd: Mapping[str, Tensor], target: CheckpointTarget) -> None:
    """Refuse the ViT of an RF-DETR of another patch or position grid than ``target``'s
    (whose tensors the DINOv2 layout would resample), naming the config of the checkpoint's
    size."""
    if not target.expected:
        return
    want = read_size({BACKBONE + k: s for k, s in target.expected.items()})
    have = _checkpoint_size(sd)
    refusal = size_refusal({k: v for k, v in have.items() if k in _BACKBONE_FIELDS}, want,
                           target.owner, any(k.startswith(RFDETR_SEG_PREFIX) for k in sd))
    if refusal:
        raise CheckpointError(refusal)


#: The size fields of the backbone part alone.
_BACKBONE_FIELDS = ('patch', 'width', 'grid')
#: Where an RF-DETR file keeps its model: ``model`` (every file), ``state_dict`` (a Lightning copy).
_FILE_PARTS = ('model', 'state_dict')
#: Where :func:`as_detector_checkpoint` keeps the file's classifier as saved (our names): a
#: fine-tuning start re-initialises a head of other classes from it (:mod:`.model_load`).
SAVED_CLASSIFIER = 'rfdetr_classifier'


def as_detector_checkpoint(ckpt: Any) -> Any:
    """An RF-DETR file (rfdetr's names, as mmengine's loaders read it) as our detector's
    checkpoint: ``{'state_dict': ..., 'meta': ..., SAVED_CLASSIFIER: ...}`` with the file's
    own classes (:func:`map_classes`: COCO's 80 or the fine-tuned ``K``, rfdetr's class names
    in ``meta['dataset_meta']['classes']``); any other checkpoint unchanged."""
    if not isinstance(ckpt, Mapping):
        return ckpt
    part = next((ckpt[p] for p in _FILE_PARTS
                 if isinstance(ckpt.get(p), Mapping) and rfdetr_layout(ckpt[p])), None)
    if part is None:
        return ckpt
    sd = model_state(part)
    names = args_class_names(ckpt.get('args'))
    saved, _ = rfdetr_to_detector(sd, as_saved=True)
    logits = int(saved[_CLASSES].shape[0])
    classes = file_classes(logits, names)
    meta: Dict[str, Any] = {'rfdetr': {'logits': logits, 'coco': classes.coco}}
    if names:
        meta['dataset_meta'] = {'classes': names}
    return {'state_dict': select_rows(saved, own_rows(classes)), 'meta': meta,
            SAVED_CLASSIFIER: class_entries(saved)}


def folder_detector_checkpoint(state: Mapping[str, Tensor], config: Optional[Mapping[str, Any]]
                               ) -> Optional[Dict[str, Any]]:
    """A transformers RF-DETR folder (``RfDetrForObjectDetection`` /
    ``RfDetrForInstanceSegmentation``: rfdetr's names, ``config.json``'s ``id2label`` a class
    for each logit, no no-object slot) as our detector's checkpoint with those classes; None
    for any other folder."""
    labels = transformers_labels(config)
    if labels is None or not rfdetr_layout(state):
        return None
    saved, _ = rfdetr_to_detector(model_state(state), as_saved=True)
    return {'state_dict': saved, 'meta': {'dataset_meta': {'classes': list(labels)}}}


#: RF-DETR's layout: a detector checkpoint whose backbone part DINOv2Backbone loads.
LAYOUTS = layouts_of(RFDETR, (RFDETR_LAYOUT,), rfdetr_layout, convert_rfdetr_layout,
                     CLASS_NAMED, backbone_family=BACKBONE_FAMILY)
