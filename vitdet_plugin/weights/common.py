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
import urllib.parse
from typing import (Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import numpy as np
import torch
from torch import Tensor, nn

from ..functional import resize_pos_grid  # noqa: F401  (re-exported: its former home)

StateDict = Dict[str, Tensor]
logger = logging.getLogger('vitdet_plugin')


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unsafe, unrecognised, or not matching the model."""


#: The only globals a detectron2 model-zoo ``.pkl`` (numpy arrays in dicts) may reference.
_PICKLE_SAFE_GLOBALS = frozenset({
    ('numpy.core.multiarray', '_reconstruct'), ('numpy._core.multiarray', '_reconstruct'),
    ('numpy.core.multiarray', 'scalar'), ('numpy._core.multiarray', 'scalar'),
    ('numpy', 'ndarray'), ('numpy', 'dtype'), ('collections', 'OrderedDict')})

_URL = re.compile(r'^https?://', re.IGNORECASE)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _PICKLE_SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f'global {module}.{name} is not allowed')


#: Where a missing checkpoint path usually came from (the hint of the not-found error).
_PATH_SOURCES = "the path given as init_cfg=dict(type='Pretrained', checkpoint=...) or on the " \
                'command line'


def resolve_checkpoint_path(path: Union[str, os.PathLike], cache_dir: Optional[str] = None,
                            source: str = _PATH_SOURCES) -> str:
    """A local file for ``path``: ``~`` expanded; an ``http(s)://`` URL downloaded once into
    ``cache_dir`` (default: torch hub's checkpoint cache ``$TORCH_HOME/hub/checkpoints``, as
    mmengine does). A missing file raises ``FileNotFoundError`` telling to check ``source``."""
    path = os.fspath(path)
    if _URL.match(path):
        cache = cache_dir or os.path.join(torch.hub.get_dir(), 'checkpoints')
        local = os.path.join(cache, os.path.basename(urllib.parse.urlparse(path).path))
        if not os.path.isfile(local):
            os.makedirs(cache, exist_ok=True)
            try:
                torch.hub.download_url_to_file(path, local, progress=False)
            except Exception as e:  # network errors come in many types
                raise CheckpointError(
                    f'cannot download checkpoint {path!r} ({type(e).__name__}: {e}); download '
                    f'it yourself and give the local path, or place it at {local!r}') from e
        return local
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file {path!r} does not exist; check {source}')
    return path


def load_checkpoint_file(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """Read a checkpoint safely: a local path or URL (see :func:`resolve_checkpoint_path`);
    ``.pth``/``.pt``/``.bin`` through ``torch.load(weights_only=True)``, a detectron2
    model-zoo ``.pkl`` through an unpickler that admits only numpy arrays and plain
    containers. Clear errors for missing, empty, unreadable or unsafe files."""
    path = resolve_checkpoint_path(path)
    if os.path.getsize(path) == 0:
        raise CheckpointError(f'checkpoint file {path!r} is empty (an interrupted download or '
                              'save?); fetch or save it again')
    if path.endswith('.pkl'):
        return load_numpy_pickle(path)
    if path.endswith('.safetensors'):
        return load_safetensors(path, map_location)
    return load_trusted_or_weights_only(path, map_location)


#: environment variable listing checkpoints (paths or URLs, separated by os.pathsep) that may be
#: read with full unpickling; nothing else is ever read that way
TRUST_ENV = 'VITDET_TRUSTED_CHECKPOINTS'
#: what torch.load raises (besides pickle.UnpicklingError) for a file that is no checkpoint:
#: EOFError for an empty file, KeyError from the legacy-format reader on arbitrary bytes (a
#: memo lookup of a byte that happens to be a pickle GET opcode)
_FORMAT_ERRORS = (EOFError, KeyError)
#: RuntimeErrors of torch's readers for a truncated / non-zip file or a plain pickle; other
#: RuntimeErrors (CUDA out of memory, a map_location naming a missing device) propagate
_FORMAT_RUNTIME_ERRORS = ('PytorchStreamReader', 'Invalid magic number')
#: how torch's weights_only unpickler names a refused object, and where it gives its reason
_GLOBAL_RE = re.compile(r'GLOBAL ([\w.]+)')
_UNPICKLER_MARK = 'WeightsUnpickler error:'


def trusted_checkpoints() -> List[str]:
    """The entries of :data:`TRUST_ENV` (``~`` expanded, local paths made absolute)."""
    entries = [e.strip() for e in os.environ.get(TRUST_ENV, '').split(os.pathsep)]
    return [e if '://' in e else os.path.realpath(os.path.expanduser(e)) for e in entries if e]


def is_trusted(*names: str) -> bool:
    """Whether any of ``names`` (the path or URL given, the local file read) is listed in
    :data:`TRUST_ENV`."""
    trusted = trusted_checkpoints()
    return any((n if '://' in n else os.path.realpath(os.path.expanduser(n))) in trusted
               for n in names if n)


def _refused_global(error: pickle.UnpicklingError) -> Optional[str]:
    """The ``module.name`` torch's weights_only unpickler refused, if that was the error."""
    found = _GLOBAL_RE.search(str(error))
    return found.group(1) if found else None


def _unpickler_detail(error: pickle.UnpicklingError) -> str:
    """torch's own reason (the line after 'WeightsUnpickler error:'), else the first line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.endswith(_UNPICKLER_MARK) and i + 1 < len(lines):
            return lines[i + 1]
    return lines[0] if lines else ''


def load_trusted_or_weights_only(path: str, map_location: Any = None,
                                 given: Optional[str] = None) -> Any:
    """Read the ``torch.save`` file ``path`` (``given``: the name the user wrote, e.g. a URL).

    ``weights_only=True`` unless ``path`` or ``given`` is listed in :data:`TRUST_ENV`. A
    refused object raises :class:`CheckpointError` naming it and the way to trust the file;
    a file that is no checkpoint raises :class:`CheckpointError` saying so; every other error
    (out of memory, a device ``map_location`` cannot reach) propagates unchanged.
    """
    if is_trusted(path, given or ''):
        logger.warning('%s lists %r: reading it with full unpickling (weights_only=False)',
                       TRUST_ENV, given or path)
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(e)
        if refused is None:
            raise _not_a_checkpoint(path, e, _unpickler_detail(e)) from e
        raise CheckpointError(
            f'refused to load checkpoint {path!r}: it contains Python objects that are not on '
            f'the weights_only allow-list (refused: {refused}); unpickling it could run '
            f'arbitrary code, so nothing was loaded or executed. If you trust this file, '
            f'list it in the environment variable {TRUST_ENV} (e.g. '
            f'{TRUST_ENV}={given or path}; several files separated by {os.pathsep!r}) and '
            f'it is read with full unpickling; or re-save it as tensors and plain '
            f'containers.') from e
    except _FORMAT_ERRORS as e:
        raise _not_a_checkpoint(path, e) from e
    except RuntimeError as e:
        if not any(marker in str(e) for marker in _FORMAT_RUNTIME_ERRORS):
            raise
        raise _not_a_checkpoint(path, e) from e


def load_numpy_pickle(path: Union[str, os.PathLike]) -> dict:
    """Read a detectron2 model-zoo ``.pkl`` (``{'model': {name: ndarray}}``) safely: only
    numpy arrays and plain containers are accepted, arrays become tensors."""
    path = resolve_checkpoint_path(path)
    try:
        with open(path, 'rb') as f:
            obj = _NumpyOnlyUnpickler(f, encoding='latin1').load()
    except pickle.UnpicklingError as e:
        if 'is not allowed' not in str(e):
            raise _not_a_checkpoint(path, e) from e
        raise CheckpointError(f'refused to load {path!r}: a .pkl checkpoint may hold only numpy '
                              f'arrays and plain containers ({e}); load only checkpoints you '
                              'trust') from e
    except Exception as e:  # not a pickle, or a truncated one
        raise _not_a_checkpoint(path, e) from e

    def to_tensors(x):
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(x))
        if isinstance(x, dict):
            return {k: to_tensors(v) for k, v in x.items()}
        return x
    return to_tensors(obj)


def load_safetensors(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """Read a ``.safetensors`` file (tensors only by design; e.g. timm's hub checkpoints).
    Needs the ``safetensors`` package (installed with timm)."""
    path = resolve_checkpoint_path(path)
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise CheckpointError(f'{path!r} is a safetensors file; install the safetensors '
                              'package (pip install safetensors) to read it') from e
    try:
        return load_file(path, device=str(map_location))
    except Exception as e:  # safetensors raises its own SafetensorError
        raise _not_a_checkpoint(path, e) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _not_a_checkpoint(path: str, e: BaseException,
                      detail: Optional[str] = None) -> CheckpointError:
    return CheckpointError(
        f'cannot read {path!r} as a checkpoint ({type(e).__name__}: '
        f'{detail or _first_line(e)}): the file is truncated or not written by torch.save '
        f'(expected a .pth/.pt file written by torch.save, a .safetensors file or a detectron2 '
        f'.pkl); save or download it again. Nothing in it was executed.')


#: Keys under which checkpoints keep their model weights, tried in this order at each level.
_WRAPPERS = ('state_dict', 'model', 'module')
#: Where checkpoints that hold *only* averaged (EMA) weights keep them: the official Swin /
#: DeiT ``model_ema``, timm's ``state_dict_ema``, mmengine's ``ema_state_dict``.
_EMA_WRAPPERS = ('model_ema', 'state_dict_ema', 'ema_state_dict')


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
    EMA weights ``model_ema`` / ``state_dict_ema`` / ``ema_state_dict`` when nothing else)."""
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
