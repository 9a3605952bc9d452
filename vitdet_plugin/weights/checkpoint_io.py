"""Safe reading of checkpoint files, in one module.

* **Safe reading.** :func:`read_checkpoint_file` reads a local path or URL: ``.pth``/``.pt``/
  ``.bin`` through ``torch.load(weights_only=True)`` (:func:`load_trusted_or_weights_only`), a
  detectron2 model-zoo ``.pkl`` through an unpickler that admits only numpy arrays and plain
  containers, ``.safetensors`` through safetensors. A checkpoint carrying arbitrary Python
  objects is refused with a :class:`CheckpointError` naming the file, the refused object and the
  way to trust it; nothing is executed. Only unpickling and file-format errors become "cannot
  read" errors; out-of-memory or device errors propagate.
* **The trust list.** A file you trust (e.g. a training checkpoint holding an
  ``argparse.Namespace``) is read with full unpickling only when its path or URL is listed in
  the environment variable ``VITDET_TRUSTED_CHECKPOINTS`` (:data:`TRUST_ENV`, ``os.pathsep``
  separated); there is no switch that turns safe loading off for all files.
* **RF-DETR's training arguments.** The ``rfdetr`` package's ``.pth`` files keep their
  ``args`` as an ``argparse.Namespace`` / ``types.SimpleNamespace`` (plain attributes): a file
  ``weights_only`` refuses for exactly those is read again with them allowed for that one read
  (``torch.serialization.safe_globals``, :data:`RFDETR_ARGS_TYPES`), and kept only when they
  sit where RF-DETR writes them (``{'model': ..., 'args': namespace}``); any other global is
  refused as before.

A transformers model folder is read by :mod:`.transformers_folder` (through these readers);
mmengine's loaders are routed through them by :mod:`vitdet_plugin.compat`.
"""
import argparse
import logging
import os
import pickle
import re
import types
import urllib.parse
from typing import IO, Any, List, Optional, Tuple, Union

import numpy as np
import torch

logger = logging.getLogger('vitdet_plugin')


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unsafe, unrecognised, or not matching the model."""


#: The only globals a detectron2 model-zoo ``.pkl`` (numpy arrays in dicts) may reference.
_PICKLE_SAFE_GLOBALS = frozenset({
    ('numpy.core.multiarray', '_reconstruct'), ('numpy._core.multiarray', '_reconstruct'),
    ('numpy.core.multiarray', 'scalar'), ('numpy._core.multiarray', 'scalar'),
    ('numpy', 'ndarray'), ('numpy', 'dtype'), ('collections', 'OrderedDict')})

#: A URL the readers download (into torch hub's cache) before reading it.
URL = re.compile(r'^https?://', re.IGNORECASE)


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
    if URL.match(path):
        cache = cache_dir or os.path.join(torch.hub.get_dir(), 'checkpoints')
        local = os.path.join(cache, os.path.basename(urllib.parse.urlparse(path).path))
        if not os.path.isfile(local):
            os.makedirs(cache, exist_ok=True)
            try:
                torch.hub.download_url_to_file(path, local, progress=False)
            except Exception as e:  # network errors come in many types
                raise CheckpointError(
                    f'cannot download checkpoint {path!r} ({type(e).__name__}: {e}); download '
                    f'it yourself and give the local path, or place it at {local!r}; or set '
                    'init_cfg=None to start from random weights') from e
        return local
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file {path!r} does not exist; check {source}')
    return path


def read_checkpoint_file(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """Read a checkpoint file safely: a local path or URL (see :func:`resolve_checkpoint_path`);
    ``.pth``/``.pt``/``.bin`` through ``torch.load(weights_only=True)``, a detectron2
    model-zoo ``.pkl`` through an unpickler that admits only numpy arrays and plain
    containers, ``.safetensors`` through safetensors. Clear errors for missing, empty,
    unreadable or unsafe files."""
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


#: The argument objects of RF-DETR's checkpoints (``checkpoint['args']`` of older files; newer
#: ones keep a dict), allowed only for the read that needs them.
RFDETR_ARGS_TYPES = (argparse.Namespace, types.SimpleNamespace)
_RFDETR_ARGS_GLOBALS = frozenset(f'{t.__module__}.{t.__qualname__}' for t in RFDETR_ARGS_TYPES)


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


def load_trusted_or_weights_only(source: Union[str, IO[bytes]], map_location: Any = None,
                                 given: Optional[str] = None) -> Any:
    """Read what ``torch.save`` wrote to the file ``source``, or to a stream read from a
    checkpoint (``given``: the name the user wrote, e.g. a URL or the directory the stream
    came from; messages and the trust list use it).

    ``weights_only=True`` unless ``source`` or ``given`` is listed in :data:`TRUST_ENV`. A
    refused object raises :class:`CheckpointError` naming it and the way to trust the file;
    a file that is no checkpoint raises :class:`CheckpointError` saying so; every other error
    (out of memory, a device ``map_location`` cannot reach) propagates unchanged.
    """
    path = source if isinstance(source, str) else (given or '<stream>')
    if is_trusted(path, given or ''):
        logger.warning('%s lists %r: reading it with full unpickling (weights_only=False)',
                       TRUST_ENV, given or path)
        return torch.load(source, map_location=map_location, weights_only=False)
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(e)
        if refused is None:
            raise _not_a_checkpoint(path, e, _unpickler_detail(e)) from e
        if refused not in _RFDETR_ARGS_GLOBALS:
            raise _refusal(path, given, refused) from e
    except _FORMAT_ERRORS as e:
        raise _not_a_checkpoint(path, e) from e
    except RuntimeError as e:
        if not any(marker in str(e) for marker in _FORMAT_RUNTIME_ERRORS):
            raise
        raise _not_a_checkpoint(path, e) from e
    return _load_rfdetr_args(source, map_location, path, given)


def _load_rfdetr_args(source: Union[str, IO[bytes]], map_location: Any, path: str,
                      given: Optional[str]) -> Any:
    """``source`` read again with ``weights_only=True`` and :data:`RFDETR_ARGS_TYPES` allowed
    for this read only; kept when it is an RF-DETR checkpoint (the namespace is its ``args``),
    else refused naming the namespace type as any other refused global."""
    if not isinstance(source, str):
        source.seek(0)
    try:
        with torch.serialization.safe_globals(list(RFDETR_ARGS_TYPES)):
            ckpt = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(e)
        if refused is None:
            raise _not_a_checkpoint(path, e, _unpickler_detail(e)) from e
        raise _refusal(path, given, refused) from e
    places = _namespaces(ckpt)
    outside = [(where, ns) for where, ns in places if where != _ARGS_PLACE]
    if isinstance(ckpt, dict) and 'model' in ckpt and not outside:
        return ckpt
    ns = (outside or places)[0][1]  # a namespace elsewhere: refused as any other global
    raise _refusal(path, given, f'{type(ns).__module__}.{type(ns).__qualname__}')


#: Where RF-DETR keeps its namespace (``checkpoint['args']``), as :func:`_namespaces` names it.
_ARGS_PLACE = "['args']"


def _namespaces(obj: Any, where: str = '') -> List[Tuple[str, Any]]:
    """The namespaces inside ``obj`` (through dicts, lists and tuples) and where each sits
    (``"['args']"``)."""
    if isinstance(obj, RFDETR_ARGS_TYPES):
        return [(where, obj)]
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    return [found for key, value in items for found in _namespaces(value, f'{where}[{key!r}]')]


def _refusal(path: str, given: Optional[str], refused: str) -> CheckpointError:
    return CheckpointError(
        f'refused to load checkpoint {path!r}: it contains Python objects that are not on '
        f'the weights_only allow-list (refused: {refused}); unpickling it could run '
        f'arbitrary code, so nothing was loaded or executed. If you trust this file, '
        f'list it in the environment variable {TRUST_ENV} (e.g. '
        f'{TRUST_ENV}={given or path}; several files separated by {os.pathsep!r}) and '
        f'it is read with full unpickling; or re-save it as tensors and plain '
        f'containers.')


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
