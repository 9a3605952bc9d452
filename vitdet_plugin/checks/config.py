"""Config checks that run before the first iteration: the model's pieces against each other
and against the dataset, and the files the config names.

The errors a changed config otherwise produces at the first forward (``Given groups=1, weight of
size [256, 192, 1, 1], expected input[1, 256, 28, 28] to have 192 channels``), hours into
training (a wrong ``num_classes`` at the first evaluation) or never (anchors at the wrong
strides) are found here from the config alone. The backbone is built on the ``meta`` device
(no weights are allocated): our backbones declare their outputs (``out_channels`` /
``out_strides``, the contract); any other backbone, and the neck, are run on meta tensors of
:data:`PROBE_SIZE` to read channels and strides. Every problem is one line that names the config
key, what it holds, what the model needs and the value to set; all of a config's problems are
reported together in one :class:`ConfigCheckError`.

Checked:

* ``_delete_`` keys left in the merged config (:func:`leftover_deletes`);
* a multi-level neck (FPN) on a single-map backbone (plain ViT / DINOv2 / DINOv3 / EVA-02):
  the ``ViTSimpleFPN`` to use instead (:mod:`.single_map`), and ``ViTSimpleFPN.in_stride``
  against the backbone's stride;
* ``model.neck.in_channels`` against the backbone's output channels (which ``out_indices``
  select), and the neck's outputs (run on meta tensors) as the heads' inputs;
* the heads' ``in_channels``, RoI extractors' ``out_channels``, ``anchor_generator`` /
  ``prior_generator`` strides, ``featmap_strides``, the deformable attention ``num_levels`` and
  Mask2Former-style ``in_channels`` / ``strides`` against the maps they read;
* every ``num_classes`` / ``num_things_classes`` / ``num_stuff_classes`` against the classes of
  the dataset (``metainfo`` or the dataset type's own), and a ``class_weight`` list against its
  ``num_classes`` (+1 for the no-object class);
* ``init_cfg`` ``Pretrained`` checkpoints, ``pretrained=`` and ``load_from`` that name a local
  file which does not exist.
"""
import copy
import math
import os
import os.path as osp
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..config import LOADER_KEYS, iter_datasets
from .single_map import is_multi_level, is_simple_fpn, simple_fpn_for
from .suggest import DELETE_KEY, dict_text

#: side of the square meta-device input the backbone / neck are probed with (divisible by every
#: stride up to 128, so strides are exact)
PROBE_SIZE = 512
#: stride-2 steps a neck may add below its coarsest input whose strides the probe reads exactly
PROBE_HALVINGS = 7
#: keys of a model config that hold a head fed by the neck (or by the backbone without one)
DENSE_HEAD_KEYS = ('rpn_head', 'bbox_head')
#: keys under which a model config keeps class counts per kind
CLASS_COUNT_KEYS = ('num_classes', 'num_things_classes', 'num_stuff_classes')


class ConfigCheckError(ValueError):
    """A config whose pieces do not fit together (or name missing files); the message lists
    every problem with the key and the value to set."""


@dataclass(frozen=True)
class FeatureMaps:
    """Channels and strides of the feature maps a module outputs, in order."""
    channels: Tuple[int, ...]
    strides: Tuple[int, ...]

    def describe(self) -> str:
        return f'channels {list(self.channels)} at strides {list(self.strides)}'


# ----------------------------------------------------------------------------- probing
def _build_on_meta(cfg: dict) -> torch.nn.Module:
    from mmdet.registry import MODELS
    cfg = copy.deepcopy(cfg)
    cfg.pop('init_cfg', None)  # weights are never loaded by a check
    cfg.pop('pretrained', None)
    with torch.device('meta'):
        return MODELS.build(cfg)


def _maps_of(outputs: Any, size: int) -> FeatureMaps:
    maps = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return FeatureMaps(tuple(int(m.shape[1]) for m in maps),
                       tuple(size // int(m.shape[-1]) for m in maps))


def backbone_maps(backbone_cfg: dict, in_channels: int = 3) -> FeatureMaps:
    """The feature maps of a backbone config: its declared contract when it has one, else read
    from a forward on meta tensors."""
    backbone = _build_on_meta(backbone_cfg)
    channels = getattr(backbone, 'out_channels', None)
    strides = getattr(backbone, 'out_strides', None)
    if channels is not None and strides is not None:
        return FeatureMaps(tuple(int(c) for c in channels), tuple(int(s) for s in strides))
    backbone.eval()
    with torch.no_grad():
        probe = torch.empty(1, in_channels, PROBE_SIZE, PROBE_SIZE, device='meta')
        return _maps_of(backbone(probe), PROBE_SIZE)


def neck_maps(neck_cfg: dict, inputs: FeatureMaps) -> FeatureMaps:
    """The feature maps a neck outputs for ``inputs``: a forward on meta tensors of an input
    side that every input stride times ``2 ** PROBE_HALVINGS`` divides, so the strides of the
    levels the neck adds are exact (14, 28, ..., 224 on a stride-14 map, never 102 / 170 from a
    rounded size)."""
    neck = _build_on_meta(neck_cfg)
    neck.eval()
    size = math.lcm(*inputs.strides) * 2 ** PROBE_HALVINGS
    feats = tuple(torch.empty(1, c, size // s, size // s, device='meta')
                  for c, s in zip(inputs.channels, inputs.strides))
    with torch.no_grad():
        return _maps_of(neck(feats), size)


def _type_name(cfg: dict) -> str:
    t = cfg.get('type')
    return t if isinstance(t, str) else getattr(t, '__name__', repr(t))


# ----------------------------------------------------------------------------- model structure
def _first_neck(model: dict) -> Tuple[Optional[dict], str]:
    neck = model.get('neck')
    if isinstance(neck, (list, tuple)):  # a sequence of necks: the first reads the backbone
        return (neck[0], 'model.neck.0') if neck else (None, 'model.neck')
    return neck, 'model.neck'


def _as_stride(value: Any) -> Any:
    """An anchor stride as an int (mmdet allows ``s`` or ``(s, s)``); other forms unchanged."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return value[0]
    return value


def _walk(node: Any, path: str) -> Iterator[Tuple[dict, str]]:
    """Every dict below ``node`` (itself included) with its dotted config path."""
    if isinstance(node, dict):
        yield node, path
        for key, value in node.items():
            yield from _walk(value, f'{path}.{key}')
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _walk(value, f'{path}.{i}')


def _check_dense_inputs(model: dict, maps: FeatureMaps, source: str) -> List[str]:
    """Heads, RoI extractors and deformable attention against the maps they read."""
    problems = []
    strides = [int(s) for s in maps.strides]
    same_channels = len(set(maps.channels)) == 1
    for key in DENSE_HEAD_KEYS:
        head = model.get(key)
        if not isinstance(head, dict):
            continue
        in_ch = head.get('in_channels')
        if isinstance(in_ch, int) and same_channels and in_ch != maps.channels[0]:
            problems.append(f'model.{key}.in_channels={in_ch} but {source} outputs '
                            f'{maps.channels[0]} channels; set model.{key}.in_channels='
                            f'{maps.channels[0]}')
        for gen in ('anchor_generator', 'prior_generator'):
            given = (head.get(gen) or {}).get('strides')
            if isinstance(given, (list, tuple)) and [_as_stride(s) for s in given] != strides:
                problems.append(f'model.{key}.{gen}.strides={list(given)} but {source} outputs '
                                f'{len(strides)} levels at strides {strides}; set '
                                f'model.{key}.{gen}.strides={strides}')
    roi_head = model.get('roi_head')
    if isinstance(roi_head, dict):
        for name in ('bbox_roi_extractor', 'mask_roi_extractor'):
            ext = roi_head.get(name)
            if not isinstance(ext, dict):
                continue
            key = f'model.roi_head.{name}'
            given = ext.get('featmap_strides')
            if isinstance(given, (list, tuple)) and list(given) != strides[:len(given)]:
                want = strides[:len(given)]
                problems.append(f'{key}.featmap_strides={list(given)} but {source} outputs '
                                f'strides {strides}; set {key}.featmap_strides={want}')
            out_ch = ext.get('out_channels')
            if isinstance(out_ch, int) and same_channels and out_ch != maps.channels[0]:
                problems.append(f'{key}.out_channels={out_ch} but {source} outputs '
                                f'{maps.channels[0]} channels; set {key}.out_channels='
                                f'{maps.channels[0]}')
    for node, path in _walk({k: v for k, v in model.items()
                             if k in ('encoder', 'decoder', 'bbox_head')}, 'model'):
        levels = node.get('num_levels')
        if isinstance(levels, int) and levels != len(strides):
            problems.append(f'{path}.num_levels={levels} but {source} outputs {len(strides)} '
                            f'levels; set {path}.num_levels={len(strides)}')
    head = model.get('panoptic_head')
    if isinstance(head, dict):  # MaskFormer / Mask2Former read the maps directly
        in_ch = head.get('in_channels')
        if isinstance(in_ch, (list, tuple)) and list(in_ch) != list(maps.channels):
            problems.append(f'model.panoptic_head.in_channels={list(in_ch)} but {source} '
                            f'outputs {maps.describe()}; set model.panoptic_head.in_channels='
                            f'{list(maps.channels)}')
        given = head.get('strides')
        if isinstance(given, (list, tuple)) and list(given) != strides:
            problems.append(f'model.panoptic_head.strides={list(given)} but {source} outputs '
                            f'strides {strides}; set model.panoptic_head.strides={strides}')
        decoder = head.get('pixel_decoder')
        outs = decoder.get('num_outs') if isinstance(decoder, dict) else None
        # the deformable pixel decoder attends over its last num_outs levels
        for node, path in _walk(decoder if isinstance(outs, int) else {},
                                'model.panoptic_head.pixel_decoder'):
            levels = node.get('num_levels')
            if isinstance(levels, int) and levels != outs:
                problems.append(f'{path}.num_levels={levels} but the pixel decoder attends over '
                                f'num_outs={outs} levels; set {path}.num_levels={outs}')
    return problems


def probe_backbone(model: dict) -> Union[FeatureMaps, str, None]:
    """The maps of ``model.backbone`` (:func:`backbone_maps`, with the data preprocessor's
    input channels), the problem line when it cannot be probed, or None without a backbone."""
    backbone = model.get('backbone')
    if not isinstance(backbone, dict):
        return None
    in_channels = int((model.get('data_preprocessor') or {}).get('in_channels', 3) or 3)
    try:
        return backbone_maps(backbone, in_channels)
    except Exception as e:  # a backbone that does not build is reported by mmdet's own error
        return (f'model.backbone ({_type_name(backbone)}) could not be probed: '
                f'{type(e).__name__}: {e}')


def check_model_structure(model: dict,
                          probed: Union[FeatureMaps, str, None] = None) -> List[str]:
    """Backbone -> neck -> heads: channel, level and stride mismatches, one line each;
    ``probed``: :func:`probe_backbone`'s result when the caller has it already."""
    maps = probe_backbone(model) if probed is None else probed
    if maps is None:
        return []
    if isinstance(maps, str):
        return [maps]
    backbone = model['backbone']
    source = f'the backbone ({_type_name(backbone)}: {maps.describe()})'
    neck, neck_key = _first_neck(model)
    if not isinstance(neck, dict):
        return _check_dense_inputs(model, maps, source)
    if len(maps.channels) == 1 and is_multi_level(neck):
        return _single_map_problems(model, neck, neck_key, maps, source)
    if is_simple_fpn(neck) and neck.get('in_stride', maps.strides[-1]) != maps.strides[-1]:
        return [f'{neck_key}.in_stride={neck["in_stride"]} but {source} outputs stride '
                f'{maps.strides[-1]}; set '
                f'{neck_key}.in_stride={maps.strides[-1]}']
    given = neck.get('in_channels')
    if isinstance(given, (list, tuple)) and list(given) != list(maps.channels):
        hint = ''
        if len(given) != len(maps.channels):
            out_idx = backbone.get('out_indices')
            hint = (f' (model.backbone.out_indices={tuple(out_idx)!r} selects '
                    f'{len(maps.channels)} maps, the neck lists {len(given)})'
                    if out_idx is not None else '')
        return [f'{neck_key}.in_channels={list(given)} does not match {source}{hint}; set '
                f'{neck_key}.in_channels={list(maps.channels)}']
    try:
        out = neck_maps(neck, maps)
    except Exception as e:
        return [f'{neck_key} ({_type_name(neck)}) fails on {source}: {type(e).__name__}: {e}']
    return _check_dense_inputs(model, out, f'the neck ({_type_name(neck)}: {out.describe()})')


def _single_map_problems(model: dict, neck: dict, neck_key: str, maps: FeatureMaps,
                         source: str) -> List[str]:
    """A multi-level neck on one backbone map: the ``ViTSimpleFPN`` to use instead, then the
    heads checked against that pyramid's real levels (one report for both)."""
    suggested = simple_fpn_for(maps.channels[0], maps.strides[0], neck, model)
    line = (f'{neck_key} is {_type_name(neck)}, a neck for a pyramid of backbone maps, but '
            f'{source} outputs one map: use ViTSimpleFPN on it, as the README does for the plain '
            f'ViTs; set {neck_key}={dict_text(suggested)}')
    out = neck_maps(suggested, maps)
    return [line] + _check_dense_inputs(model, out, f'the neck (ViTSimpleFPN: {out.describe()})')


# ----------------------------------------------------------------------------- classes
def dataset_classes(cfg: Any, stage: str = 'train') -> Optional[Tuple[str, Dict[str, Any]]]:
    """``(config key, metainfo)`` of the first dataset of ``stage`` (its ``metainfo`` merged
    over the dataset type's ``METAINFO``), or None when the config has none."""
    from mmdet.registry import DATASETS
    for key in LOADER_KEYS[stage]:
        loader = cfg.get(key)
        if not loader:
            continue
        for ds, path in iter_datasets(loader.get('dataset'), f'{key}.dataset'):
            ds_type = ds.get('type')
            cls = DATASETS.get(ds_type) if isinstance(ds_type, str) else ds_type
            meta = dict(getattr(cls, 'METAINFO', None) or {})
            meta.update(ds.get('metainfo') or {})
            return path, meta
    return None


def _expected_counts(meta: Dict[str, Any]) -> Dict[str, Tuple[int, str]]:
    """``num_*`` key -> (expected count, where it comes from)."""
    classes = meta.get('classes')
    things, stuff = meta.get('thing_classes'), meta.get('stuff_classes')
    out: Dict[str, Tuple[int, str]] = {}
    if things is not None:  # a panoptic dataset: the detection heads see the thing classes
        out['num_classes'] = (len(things), 'thing_classes')
        out['num_things_classes'] = (len(things), 'thing_classes')
        out['num_stuff_classes'] = (len(stuff or ()), 'stuff_classes')
    elif classes is not None:
        out['num_classes'] = (len(classes), 'classes')
        out['num_things_classes'] = (len(classes), 'classes')
    return out


def check_num_classes(cfg: Any, stages: Sequence[str] = ('train',)) -> List[str]:
    """Every class count of the model (``rpn_head`` excepted) against the dataset's classes,
    and ``class_weight`` lists against their ``num_classes`` (+1 for the no-object class)."""
    model = cfg.get('model')
    found = None
    for stage in stages:
        found = dataset_classes(cfg, stage)
        if found:
            break
    if not isinstance(model, dict) or found is None:
        return []
    ds_key, meta = found
    expected = _expected_counts(meta)
    problems = []
    for node, path in _walk({k: v for k, v in model.items() if k != 'rpn_head'}, 'model'):
        if path.endswith(('.semantic_head', '.seg_head')):
            continue  # semantic heads count things + stuff their own way
        counts = {}  # the class counts once the lines above are applied
        for key in CLASS_COUNT_KEYS:
            value = node.get(key)
            if not isinstance(value, int):
                continue
            counts[key] = value
            if key not in expected:
                continue
            want, source = expected[key]
            if value != want:
                counts[key] = want
                names = list(meta.get(source) or ())
                shown = names if len(names) <= 10 else names[:10] + ['...']
                problems.append(f'{path}.{key}={value} but {ds_key} has {want} {source} '
                                f'{shown}; set {path}.{key}={want}')
        num = counts.get('num_classes')
        if num is None and 'num_things_classes' in counts:
            num = counts['num_things_classes'] + counts.get('num_stuff_classes', 0)
        if num is None:
            continue
        weights = node.get('class_weight')
        if isinstance(weights, (list, tuple)) and len(weights) not in (num, num + 1):
            problems.append(f'{path}.class_weight has {len(weights)} entries for '
                            f'num_classes={num}; give num_classes + 1 = {num + 1} (the last '
                            'weighs the no-object class)' + _weights_fix(path, weights, num))
        for loss_key, loss in node.items():
            cw = loss.get('class_weight') if isinstance(loss, dict) else None
            if isinstance(cw, (list, tuple)) and len(cw) not in (num, num + 1):
                problems.append(f'{path}.{loss_key}.class_weight has {len(cw)} entries for '
                                f'{num} classes; give {num + 1} ({num} classes + the '
                                'no-object class)' + _weights_fix(f'{path}.{loss_key}', cw, num))
    return problems


def _weights_fix(path: str, weights: Sequence[Any], num: int) -> str:
    """``; set ...class_weight=[...]`` when every class has the same weight (the config's
    class weight for ``num`` classes, then its no-object weight); else nothing to set."""
    classes = list(weights[:-1])
    if not classes or any(w != classes[0] for w in classes):
        return ''
    return f'; set {path}.class_weight={[classes[0]] * num + [weights[-1]]}'


# ----------------------------------------------------------------------------- files
def _missing_local(path: Any) -> bool:
    """``path`` names a local file (not a URL) that does not exist."""
    return isinstance(path, str) and bool(path) and '://' not in path \
        and not osp.exists(osp.expanduser(path))


def check_checkpoint_files(cfg: Any) -> List[str]:
    """``init_cfg`` / ``pretrained`` / ``load_from`` naming a local file that does not exist."""
    problems = []
    cwd = os.getcwd()
    model = cfg.get('model')
    for node, path in _walk(model if isinstance(model, dict) else {}, 'model'):
        ckpt = node.get('checkpoint') if node.get('type') == 'Pretrained' else None
        owner = path.rsplit('.init_cfg', 1)[0] if path.endswith('.init_cfg') else path
        if _missing_local(ckpt):
            problems.append(f'{path}.checkpoint={ckpt!r} does not exist (relative paths are read '
                            f'from {cwd}); download the weights there or point the key at your '
                            f'copy (random init instead: {owner}.init_cfg=None)')
        pre = node.get('pretrained')
        if _missing_local(pre):
            problems.append(f'{path}.pretrained={pre!r} does not exist (relative paths are read '
                            f'from {cwd}); point it at your copy or set {path}.pretrained=None')
    load_from = cfg.get('load_from')
    if _missing_local(load_from):
        problems.append(f'load_from={load_from!r} does not exist (relative paths are read from '
                        f'{cwd}); point it at your checkpoint or set load_from=None')
    return problems


# ----------------------------------------------------------------------------- merging
def _has_dict_in_list(value: Any) -> bool:
    """``--cfg-options`` cannot write a dict inside a list."""
    if isinstance(value, dict):
        return any(_has_dict_in_list(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, dict) or _has_dict_in_list(v) for v in value)
    return False


def leftover_deletes(cfg: Any) -> List[str]:
    """Every ``_delete_`` key left in the merged config, one line each: mmengine removes it
    only where a base config has the key to replace, so elsewhere the builder of that section
    gets it as an argument (``TypeError: IterBasedTrainLoop.__init__() got an unexpected keyword
    argument '_delete_'``) or silently ignores it."""
    root = cfg._cfg_dict.to_dict() if hasattr(cfg, '_cfg_dict') else dict(cfg)
    problems = []
    for key, value in root.items():
        for node, path in _walk(value, str(key)):
            if DELETE_KEY not in node:
                continue
            kept = {k: v for k, v in node.items() if k != DELETE_KEY}
            fix = '' if _has_dict_in_list(kept) else f', or set {path}={dict_text(kept)}'
            problems.append(f'{path}.{DELETE_KEY}={node[DELETE_KEY]!r} is left in the merged '
                            f'config (no base config has a {path} for it to replace), so what '
                            f"builds {path} gets it as an argument (TypeError: unexpected keyword "
                            f"argument '{DELETE_KEY}'); remove {DELETE_KEY}=True from {path} in "
                            f'the config file{fix}')
    return problems


def without_deletes(cfg: Any) -> Any:
    """A copy of ``cfg`` without its leftover ``_delete_`` keys (``cfg`` when it has none), so
    the checks after :func:`leftover_deletes` see what the fixed config holds."""
    if not leftover_deletes(cfg):
        return cfg
    fixed = copy.deepcopy(cfg)
    for key in list(fixed.keys()):
        for node, _ in _walk(fixed[key], str(key)):
            node.pop(DELETE_KEY, None)
    return fixed


# ----------------------------------------------------------------------------- entry
def config_problems(cfg: Any, stages: Sequence[str] = ('train',), weights: bool = True,
                    probed: Union[FeatureMaps, str, None] = None) -> List[str]:
    """Every problem :func:`check_config` would report, one line each (``weights``: also the
    checkpoint files training would load; ``probed``: see :func:`check_model_structure`)."""
    leftovers = leftover_deletes(cfg)
    cfg = without_deletes(cfg)
    model = cfg.get('model')
    problems = leftovers
    problems += check_model_structure(model, probed) if isinstance(model, dict) else []
    problems += check_num_classes(cfg, stages)
    return problems + (check_checkpoint_files(cfg) if weights else [])


def raise_problems(problems: Sequence[str], cfg: Any, config_path: Optional[str] = None) -> None:
    """One :class:`ConfigCheckError` listing ``problems`` (nothing when there are none)."""
    if problems:
        name = config_path or getattr(cfg, 'filename', None) or 'the config'
        head = f'{name}: {len(problems)} problem{"s" if len(problems) > 1 else ""} found ' \
               'before training'
        raise ConfigCheckError('\n'.join([head] + [f'  {p}' for p in problems]))


def check_config(cfg: Any, stages: Sequence[str] = ('train',),
                 config_path: Optional[str] = None, weights: bool = True) -> None:
    """Raise :class:`ConfigCheckError` listing every problem of ``cfg`` (see the module
    docstring); ``stages`` pick the dataset the class counts are compared with; ``weights``
    checks that the checkpoints training loads exist (not needed to evaluate one)."""
    from mmengine.registry import init_default_scope
    init_default_scope(cfg.get('default_scope') or 'mmdet')
    raise_problems(config_problems(cfg, stages, weights), cfg, config_path)
