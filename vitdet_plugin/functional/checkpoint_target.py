"""The checkpoint contract between the models and the loader (:mod:`vitdet_plugin.weights`).

A model describes itself with a :class:`CheckpointTarget` (its ``checkpoint_target()``) and
asks the :func:`checkpoint_loader` to load its ``init_cfg`` checkpoint; the loader is plugged in
by :mod:`vitdet_plugin.weights` when it is imported (``import vitdet_plugin`` does that before
it imports the models). So the dependency points from ``weights/`` to this module and never
from a model to ``weights/``.
"""
import dataclasses
import os
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Pair = Tuple[int, int]
#: What a checkpoint can be given as: a path, a URL, a transformers folder or a loaded dict.
CheckpointSource = Union[str, os.PathLike, Mapping]


@dataclasses.dataclass(frozen=True)
class CheckpointTarget:
    """The module a checkpoint is converted for; the loader never sees the module itself.

    Attributes:
        family: the checkpoint family it loads (``'Swin'``, ``'Swin V2'``, ``'ViT'``,
            ``'DINOv2'``, ``'DINOv3'``, ``'EVA-02'``, ``'simple FPN'``, ``'RF-DETR'``: a
            whole RF-DETR detector; the keys of :data:`vitdet_plugin.weights.FAMILY_BACKBONES`).
        owner: its type name, for messages (``'SwinBackbone'``).
        expected: ``{name: shape}`` of its state dict; None converts without a module (names
            only, ``tools/convert_weights.py``).
        window_size: Swin V1: the attention window (bias tables are resized to it).
        src_window_size: Swin V1: the checkpoint's window when it is rectangular (a load
            option of ``init_cfg``, not the module's).
        pos_grid: the stored absolute-position grid (position embeddings are resized to it).
        out_indices: Swin: the stages returned (output norms of the others are skipped).
        pretrained_windows: Swin V2: per stage, the window relative offsets are normalised by.
        patch_size: the patch kernel size (a family kernel of another size is resampled).
        rope_temperature, rope_ref_grid: DINOv3 / EVA-02: the rotary settings.
        in_stride: simple FPN: the stride of its input.
        arch_presets: the backbone's arch presets (``{name: fields}``), to name the one that
            builds a checkpoint of another size.
        arch_fields: the plain ViTs' resolved arch (``embed_dims``, ``num_heads``, ``mlp``,
            ``num_reg_tokens``, ...), checked against a transformers folder's config.json.
    """
    family: str
    owner: str
    expected: Optional[Mapping[str, torch.Size]] = None
    window_size: Optional[Pair] = None
    src_window_size: Optional[Pair] = None
    pos_grid: Optional[Pair] = None
    out_indices: Optional[Tuple[int, ...]] = None
    pretrained_windows: Tuple[Pair, ...] = ()
    patch_size: Optional[Pair] = None
    rope_temperature: Optional[float] = None
    rope_ref_grid: Optional[Pair] = None
    in_stride: int = 16
    arch_presets: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    arch_fields: Mapping[str, object] = dataclasses.field(default_factory=dict)


class LoadReport(NamedTuple):
    """What a strict load did: the keys loaded, the model keys that were allowed to stay at
    their initial values, the checkpoint keys dropped as not the module's, the checkpoint's
    layout (``'DINOv2 official'``; '' where no layout table was asked) and the tensors resampled
    to the module's sizes (``'patch_embed.proj.weight 14x14 -> 16x16'``)."""
    loaded: Sequence[str]
    missing_allowed: Sequence[str]
    dropped: Sequence[str]
    layout: str = ''
    resampled: Sequence[str] = ()


StateDict = Dict[str, torch.Tensor]
#: ``(checkpoint, target, prefix) -> (state dict to load, report)``: converts ``checkpoint``
#: (its part under ``prefix``) for ``target`` strictly, or raises naming the problem and the fix.
ConvertForTarget = Callable[[CheckpointSource, CheckpointTarget, Optional[str]],
                            Tuple[StateDict, LoadReport]]
#: ``(checkpoint, prefix, expected, owner, source) -> (state dict, report)``: reads the part
#: under ``prefix`` as saved (our / mmdet's own names, no conversion), checked strictly against
#: ``expected`` (``owner``, ``source``: how messages name the module and the checkpoint).
ReadAsSaved = Callable[[CheckpointSource, Optional[str], Mapping[str, torch.Size], str, str],
                       Tuple[StateDict, LoadReport]]


#: ``(module, options) -> loaded``: loads the Pretrained ``init_cfg`` checkpoint of ``module``
#: (converted for its ``checkpoint_target()`` with the load ``options`` named, read from the same
#: entry) and marks it initialised; False when its ``init_cfg`` names none.
LoadInit = Callable[[nn.Module, Sequence[str]], bool]


class CheckpointLoader(NamedTuple):
    """The loads the models ask for (:data:`ConvertForTarget`, :data:`ReadAsSaved`,
    :data:`LoadInit`)."""
    convert: ConvertForTarget
    read_as_saved: ReadAsSaved
    load_init: LoadInit


def pretrained_init_cfg(init_cfg: Any) -> Optional[dict]:
    """The ``dict(type='Pretrained', checkpoint=...)`` entry of an mmengine ``init_cfg`` (a
    dict or a list of dicts), or None."""
    cfgs = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
    found = [c for c in cfgs if isinstance(c, dict) and c.get('type') == 'Pretrained']
    if len(found) > 1:
        raise ValueError(f'init_cfg lists {len(found)} Pretrained checkpoints; give one')
    return found[0] if found else None


_plugged: Dict[str, CheckpointLoader] = {}


def plug_checkpoint_loader(loader: CheckpointLoader) -> None:
    """Make ``loader`` the one the models call (:mod:`vitdet_plugin.weights` does, once)."""
    _plugged['loader'] = loader


def checkpoint_loader() -> CheckpointLoader:
    """The plugged-in loader; a ``RuntimeError`` naming the fix when none is."""
    if 'loader' not in _plugged:
        raise RuntimeError('no checkpoint loader is plugged in: import vitdet_plugin (its '
                           'weights package plugs the layout table in) before loading weights')
    return _plugged['loader']
