"""Checkpoint reading and strict, reported state-dict loading shared by all converters.

Everything here is safe by construction: files are read with ``torch.load(weights_only=True)``
(a checkpoint carrying arbitrary Python objects is refused, nothing is executed), and a state
dict is only loaded when its keys and shapes match the model, except for keys the caller
explicitly allows to stay at their initial values; every difference is named in the error.
"""
import logging
import os
import pickle
import re
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

StateDict = Dict[str, Tensor]
logger = logging.getLogger('vitdet_plugin')


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unsafe, unrecognised, or not matching the model."""


def load_checkpoint_file(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """Read a checkpoint with ``weights_only=True``; clear errors for missing or unsafe files."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f'checkpoint file {path!r} does not exist; check the path given as '
            f"init_cfg=dict(type='Pretrained', checkpoint=...) or on the command line")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f'refused to load {path!r}: it contains Python objects other than tensors and '
            f'plain containers, and loading it could run arbitrary code (torch.load with '
            f'weights_only=True said: {str(e).splitlines()[0]}). Load only checkpoints you '
            f'trust; re-save a trusted one as a plain state dict of tensors.') from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f'cannot read checkpoint {path!r}: {e}') from e


def unwrap_state_dict(ckpt: Mapping) -> StateDict:
    """Find the tensor dict inside common wrappers (``state_dict``, ``model``, ``module``)."""
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f'a checkpoint must be a dict, got {type(ckpt).__name__}')
    sd = ckpt
    for _ in range(3):
        for wrapper in ('state_dict', 'model', 'module'):
            inner = sd.get(wrapper)
            if isinstance(inner, Mapping) and inner:
                sd = inner
                break
        else:
            break
    tensors = {k: v for k, v in sd.items() if isinstance(v, Tensor)}
    if not tensors:
        raise CheckpointError('the checkpoint holds no tensors (looked at the top level and '
                              "under 'state_dict', 'model' and 'module')")
    if any(k.startswith('module.') for k in tensors):  # saved from DataParallel/DDP
        tensors = {k[len('module.'):] if k.startswith('module.') else k: v
                   for k, v in tensors.items()}
    return tensors


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


class LoadReport(NamedTuple):
    """What :func:`load_state_dict_checked` did."""
    loaded: List[str]
    missing_allowed: List[str]


def _summarise(keys: List[str], limit: int = 12) -> str:
    shown = ', '.join(keys[:limit])
    return shown + (f', ... ({len(keys) - limit} more)' if len(keys) > limit else '')


def load_state_dict_checked(model: nn.Module, sd: Mapping[str, Tensor],
                            allow_missing: Iterable[str] = (),
                            source: str = 'checkpoint') -> LoadReport:
    """Load ``sd`` into ``model``; raise :class:`CheckpointError` on any mismatch.

    Args:
        allow_missing: regexes of model keys that may be absent from ``sd`` (they keep their
            initial values and are logged), e.g. detection-only output norms when loading a
            classification checkpoint.
        source: how to name the checkpoint in messages.
    """
    own = model.state_dict()
    allow = re.compile('|'.join(f'(?:{p})' for p in allow_missing)) if allow_missing else None
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    mismatched = [f'{k}: {source} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}'
                  for k in sd if k in own and sd[k].shape != own[k].shape]
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
            f'the {source} does not match {type(model).__name__}: ' + '; '.join(problems) +
            '. Check that the architecture arguments (arch, embed dims, depths, heads, '
            'window/patch size) match the checkpoint.')
    model.load_state_dict(dict(sd), strict=False)
    allowed = [k for k in missing if k not in missing_bad]
    if allowed:
        logger.warning('%s: %d keys not in the %s keep their initial values: %s',
                       type(model).__name__, len(allowed), source, _summarise(allowed))
    return LoadReport(loaded=list(sd), missing_allowed=allowed)


def resize_pos_grid(pos: Tensor, size: Tuple[int, int], mode: str = 'bicubic') -> Tensor:
    """Resize a ``(1, C, H, W)`` position grid to ``size`` (float32 math, dtype preserved)."""
    if tuple(pos.shape[-2:]) == tuple(size):
        return pos
    out = torch.nn.functional.interpolate(pos.float(), size=size, mode=mode, align_corners=False)
    return out.to(pos.dtype)
