"""Strict, reported state-dict handling shared by all converters: the tensors of a checkpoint
(unwrapped, prefixes selected, keys dropped) and loading them into a model.

Files are read by :mod:`.checkpoint_io` (safe by construction); a state dict is only loaded when
its keys and shapes match the model, except for keys the caller explicitly allows to stay at
their initial values; every difference is named in the error.
"""
import logging
import math
import os
import re
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..functional.checkpoint_target import LoadReport, StateDict
from .checkpoint_io import CheckpointError, read_checkpoint_file
from .transformers_folder import is_transformers_folder, load_transformers_folder

logger = logging.getLogger('vitdet_plugin')


#: Keys under which checkpoints keep their model weights, tried in this order at each level.
_WRAPPERS = ('state_dict', 'model', 'module')
#: Where checkpoints that hold *only* averaged (EMA) weights keep them: the official Swin /
#: DeiT ``model_ema``, timm's ``state_dict_ema``, mmengine's ``ema_state_dict``, D-FINE's /
#: DEIMv2's ``ema`` (``{'ema': {'module': ...}}``).
_EMA_WRAPPERS = ('model_ema', 'state_dict_ema', 'ema_state_dict', 'ema')


def _tensors_of(sd: Mapping) -> StateDict:
    for _ in range(3):
        for wrapper in _WRAPPERS:
            inner = sd.get(wrapper)
            if isinstance(inner, Mapping) and inner:
                sd = inner
                break
        else:
            break
    return {k: v for k, v in sd.items() if isinstance(v, Tensor)}


def unwrap_state_dict(ckpt: Mapping) -> StateDict:
    """Find the tensor dict inside common wrappers (``state_dict``, ``model``, ``module``; the
    EMA weights ``model_ema`` / ``state_dict_ema`` / ``ema_state_dict`` / ``ema`` when nothing
    else)."""
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f'a checkpoint must be a dict, got {type(ckpt).__name__}')
    tensors = _tensors_of(ckpt)
    for ema in _EMA_WRAPPERS:
        if tensors:
            break
        if isinstance(ckpt.get(ema), Mapping):
            tensors = _tensors_of(ckpt[ema])
    if not tensors:
        raise CheckpointError(
            'the checkpoint holds no tensors (looked at the top level, under '
            f"{', '.join(map(repr, _WRAPPERS + _EMA_WRAPPERS))}); its top-level keys are "
            f'{_summarise([str(k) for k in ckpt])}. Pass the tensor dict itself, or save the '
            'model with torch.save(model.state_dict(), path)')
    if any(k.startswith('module.') for k in tensors):  # saved from DataParallel/DDP
        tensors = {k[len('module.'):] if k.startswith('module.') else k: v
                   for k, v in tensors.items()}
    return tensors


def load_checkpoint_file(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """A checkpoint read safely: a Hugging Face transformers model folder
    (:func:`~.transformers_folder.load_transformers_folder`) or a file / URL
    (:func:`~.checkpoint_io.read_checkpoint_file`)."""
    if is_transformers_folder(path):
        return load_transformers_folder(path, map_location)
    return read_checkpoint_file(path, map_location)


def checkpoint_state_dict(checkpoint: Union[str, os.PathLike, Mapping],
                          prefix: Optional[str] = None) -> StateDict:
    """The tensors of a checkpoint (a file or URL read by :func:`load_checkpoint_file`, or an
    already loaded dict), unwrapped, with the keys under ``prefix`` (if given) un-prefixed."""
    ckpt = (load_checkpoint_file(checkpoint) if isinstance(checkpoint, (str, os.PathLike))
            else checkpoint)
    sd = unwrap_state_dict(ckpt)
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        if not any(k.startswith(prefix) for k in sd):
            raise CheckpointError(
                f'no key of the checkpoint starts with prefix={prefix!r}; its keys start like '
                f'{_summarise(sorted({k.split(".")[0] + "." for k in sd}))}. Give one of '
                'those as the prefix, or none to let the format be detected')
        sd = select_prefix(sd, prefix)
    return sd


def select_prefix(sd: Mapping[str, Tensor], prefix: str) -> StateDict:
    """Keys under ``prefix`` with it removed; ``sd`` unchanged when no key has the prefix."""
    if not any(k.startswith(prefix) for k in sd):
        return dict(sd)
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def drop_keys(sd: Mapping[str, Tensor], patterns: Iterable[str]) -> Tuple[StateDict, List[str]]:
    """Remove keys matching any regex in ``patterns``; returns the rest and the dropped names."""
    regex = re.compile('|'.join(f'(?:{p})' for p in patterns)) if patterns else None
    kept, dropped = {}, []
    for k, v in sd.items():
        if regex is not None and regex.search(k):
            dropped.append(k)
        else:
            kept[k] = v
    return kept, dropped


def backbone_part(sd: Mapping[str, Tensor],
                  non_backbone: Iterable[str]) -> Tuple[StateDict, List[str]]:
    """The backbone's weights of a (detector) state dict: the ``backbone.``-prefixed keys without
    the prefix when there are any, minus the keys matching ``non_backbone``; and what was
    dropped."""
    dropped: List[str] = []
    if any(k.startswith('backbone.') for k in sd):
        dropped += [k for k in sd if not k.startswith('backbone.')]
        sd = select_prefix(sd, 'backbone.')
    kept, dropped_now = drop_keys(sd, non_backbone)
    return kept, dropped + dropped_now


def hw_pair(size: Sequence[int], name: str) -> Tuple[int, int]:
    """``size`` (a tuple, a config's list, a ``torch.Size``) as an ``(h, w)`` tuple; any other
    length raises a ``ValueError`` naming ``name``."""
    if len(size) != 2:
        raise ValueError(f'{name} must be a pair (h, w), got {tuple(size)!r}')
    return size[0], size[1]


def note_resampled(resampled: Optional[List[str]], key: str, before: Sequence[int],
                   after: Sequence[int]) -> None:
    """Add ``'<key> <before> -> <after>'`` (shapes as ``14x14``) to ``resampled`` (a
    converter's report of the tensors it resized to the model's sizes) when the shape changed;
    nothing when ``resampled`` is None."""
    if resampled is not None and tuple(before) != tuple(after):
        resampled.append(f"{key} {'x'.join(map(str, before))} -> {'x'.join(map(str, after))}")


def is_square_grid(cells: int) -> bool:
    """Whether ``cells`` positions fill a square grid of at least one cell (``s * s``)."""
    return cells > 0 and math.isqrt(cells) ** 2 == cells


def _summarise(keys: List[str], limit: int = 12) -> str:
    shown = ', '.join(keys[:limit])
    return shown + (f', ... ({len(keys) - limit} more)' if len(keys) > limit else '')


def check_state_dict(sd: Mapping[str, Tensor], expected: Mapping[str, torch.Size],
                     allow_missing: Iterable[str] = (), source: str = 'checkpoint',
                     owner: str = 'the model', dropped: Sequence[str] = ()) -> LoadReport:
    """Check ``sd`` against the ``{name: shape}`` a module ``owner`` expects; raise
    :class:`CheckpointError` naming every mismatched, missing and unexpected key.

    Args:
        allow_missing: regexes of expected keys that may be absent from ``sd`` (they keep their
            initial values and are logged), e.g. detection-only output norms when loading a
            classification checkpoint.
        source, owner: how to name the checkpoint and the module in messages.
        dropped: the checkpoint keys the conversion dropped (reported).
    """
    allow = re.compile('|'.join(f'(?:{p})' for p in allow_missing)) if allow_missing else None
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    mismatched = [f'{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k])}'
                  for k in sd if k in expected and sd[k].shape != expected[k]]
    missing_bad = [k for k in missing if allow is None or not allow.search(k)]
    problems = []
    if mismatched:
        problems.append(f'shape mismatch for {len(mismatched)} keys: {_summarise(mismatched)}')
    if missing_bad:
        problems.append(f'missing from the {source}: {_summarise(missing_bad)}')
    if unexpected:
        problems.append(f'unexpected in the {source}: {_summarise(unexpected)}')
    if problems:
        raise CheckpointError(
            f'the {source} does not match {owner}: ' + '; '.join(problems) +
            '. Check that the architecture arguments (arch, embed dims, depths, heads, '
            'window/patch size) match the checkpoint.')
    allowed = [k for k in missing if k not in missing_bad]
    if allowed:
        logger.warning('%s: %d keys not in the %s keep their initial values: %s',
                       owner, len(allowed), source, _summarise(allowed))
    return LoadReport(loaded=list(sd), missing_allowed=allowed, dropped=list(dropped))


def load_state_dict_checked(model: nn.Module, sd: Mapping[str, Tensor],
                            allow_missing: Iterable[str] = (),
                            source: str = 'checkpoint') -> LoadReport:
    """Load ``sd`` into ``model`` after :func:`check_state_dict` against its own state dict."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    report = check_state_dict(sd, expected, allow_missing, source, type(model).__name__)
    model.load_state_dict(dict(sd), strict=False)
    return report


def read_as_saved(checkpoint: Union[str, os.PathLike, Mapping], prefix: Optional[str],
                  expected: Mapping[str, torch.Size], owner: str,
                  source: str = 'checkpoint') -> Tuple[StateDict, LoadReport]:
    """The ``prefix`` part of a checkpoint (e.g. ``'neck.'`` of a detector's) in our / mmdet's
    own layout (no conversion), checked strictly against the ``{name: shape}`` module ``owner``
    expects: every key of the part must be a key of the module with its shape and the other way
    round, else :class:`CheckpointError` names the differences."""
    sd = checkpoint_state_dict(checkpoint, prefix)
    return sd, check_state_dict(sd, expected, source=source, owner=owner)
