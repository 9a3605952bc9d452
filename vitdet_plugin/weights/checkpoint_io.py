"""Checkpoint I/O: every read of a checkpoint file, safe by construction, in one module.

* **Safe reading.** :func:`load_checkpoint_file` reads a local path or URL: ``.pth``/``.pt``/
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
* **mmengine's checkpoints under weights_only.** torch >= 2.6 loads with ``weights_only=True``
  by default, and mmengine 0.10.7's resume then fails on the objects its checkpoints carry
  (``HistoryBuffer`` in the message hub, its statistics methods, numpy arrays and scalars;
  mmengine#1655). :func:`register_safe_globals` allow-lists exactly those with
  :func:`torch.serialization.add_safe_globals`; ``weights_only`` stays on.
* **mmengine's loaders.** :func:`install_safe_checkpoint_loader` makes mmengine's loaders for
  local files and for URLs (``http(s)://``, and through it ``modelzoo://``, ``torchvision://``,
  ``open-mmlab://``, ``mmcls://``), used by ``Runner.resume`` (``tools/train.py --resume``),
  ``load_from`` and ``load_checkpoint``, read through :func:`load_trusted_or_weights_only`
  (mmengine's own URL loader goes through torch hub's ``load_state_dict_from_url``, which
  unpickles anything).

Importing this module changes nothing outside it: the two installers are called by
:func:`vitdet_plugin.compat.apply` (``import vitdet_plugin``), for every OpenMMLab library in the
process.
"""
import json
import logging
import os
import pickle
import re
import urllib.parse
from typing import Any, Callable, List, Optional, Tuple, Union

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
                    f'it yourself and give the local path, or place it at {local!r}; or set '
                    'init_cfg=None to start from random weights') from e
        return local
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file {path!r} does not exist; check {source}')
    return path


def load_checkpoint_file(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """Read a checkpoint safely: a local path or URL (see :func:`resolve_checkpoint_path`);
    ``.pth``/``.pt``/``.bin`` through ``torch.load(weights_only=True)``, a detectron2
    model-zoo ``.pkl`` through an unpickler that admits only numpy arrays and plain
    containers; a Hugging Face transformers model folder (:func:`load_transformers_folder`).
    Clear errors for missing, empty, unreadable or unsafe files."""
    if is_transformers_folder(path):
        return load_transformers_folder(path, map_location)
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


#: A transformers model folder's files (``save_pretrained``): the config, one weights file or
#: an index of shards, in the order they are looked for (safetensors first).
TRANSFORMERS_CONFIG = 'config.json'
TRANSFORMERS_WEIGHTS = (('model.safetensors', 'model.safetensors.index.json'),
                        ('pytorch_model.bin', 'pytorch_model.bin.index.json'))


def is_transformers_folder(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a local directory (read as a transformers model folder)."""
    return not _URL.match(os.fspath(path)) and os.path.isdir(os.path.expanduser(path))


def read_transformers_config(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The ``config.json`` of a transformers model folder; None when ``path`` is no folder.
    A folder without one is refused (it is no ``save_pretrained`` folder)."""
    if not is_transformers_folder(path):
        return None
    folder = os.path.expanduser(os.fspath(path))
    config = os.path.join(folder, TRANSFORMERS_CONFIG)
    if not os.path.isfile(config):
        raise CheckpointError(
            f'{folder!r} is a directory without {TRANSFORMERS_CONFIG}: a checkpoint directory '
            f'must be a Hugging Face transformers model folder (save_pretrained writes '
            f'{TRANSFORMERS_CONFIG} and model.safetensors); give that folder or a checkpoint '
            'file')
    with open(config) as f:
        return json.load(f)


def load_transformers_folder(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """The tensors of a transformers model folder: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (``model-0000k-of-0000n.safetensors``); else
    ``pytorch_model.bin`` (``weights_only``) or its shards. A shard the index names but the
    folder lacks, or a tensor the index names but no shard holds, is refused naming it."""
    read_transformers_config(path)
    folder = os.path.expanduser(os.fspath(path))
    for single, index in TRANSFORMERS_WEIGHTS:
        reader: Callable[[str, str], Any] = (load_safetensors if single.endswith('.safetensors')
                                             else load_trusted_or_weights_only)
        if os.path.isfile(os.path.join(folder, single)):
            return reader(os.path.join(folder, single), map_location)
        if not os.path.isfile(os.path.join(folder, index)):
            continue
        with open(os.path.join(folder, index)) as f:
            weight_map: dict = json.load(f)['weight_map']
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise CheckpointError(
                f'the sharded checkpoint {folder!r} lacks {", ".join(missing)} (of the '
                f'{len(shards)} shards its {index} lists): download or copy the missing '
                'shard into the folder')
        sd: dict = {}
        for shard in shards:
            sd.update(reader(os.path.join(folder, shard), map_location))
        absent = [k for k in weight_map if k not in sd]
        if absent:
            raise CheckpointError(
                f'the sharded checkpoint {folder!r}: {index} places {absent[0]!r} in '
                f'{weight_map[absent[0]]!r}, which does not hold it; the shard is from '
                'another save: download the folder again')
        return sd
    names = ', '.join(n for pair in TRANSFORMERS_WEIGHTS for n in pair)
    raise CheckpointError(f'the transformers folder {folder!r} has no weights: expected one '
                          f'of {names}')


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


# ----------------------------------------------------------------------------- mmengine's objects
_HISTORY_BUFFER_STATISTICS = ('min', 'max', 'mean', 'current')


def _history_buffer_getattr(obj: object, name: str) -> object:
    """``getattr`` restricted to what mmengine's ``HistoryBuffer`` pickles.

    A ``HistoryBuffer`` carries its statistics methods (``min``, ``max``, ``mean``,
    ``current`` and custom registered ones), which pickle writes as
    ``builtins.getattr(HistoryBuffer, 'min')``. Allow-listing the real ``getattr`` would let a
    checkpoint fetch any attribute of any allowed object, so only those lookups are served.
    """
    from mmengine.logging import HistoryBuffer

    # the class-level registry fills lazily, so the built-ins are listed explicitly (read
    # before ``obj is HistoryBuffer``, which narrows the untyped class to ``object`` for mypy)
    registered = HistoryBuffer._statistics_methods
    if obj is HistoryBuffer and (name in _HISTORY_BUFFER_STATISTICS or name in registered):
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f'refused builtins.getattr({obj!r}, {name!r}) while loading a checkpoint: only '
        f'HistoryBuffer statistics methods may be looked up')


#: What ``torch.serialization.add_safe_globals`` takes: a class or ``(callable, its name)``.
SafeGlobal = Union[type, Tuple[Callable[..., Any], str]]


def mmengine_safe_globals() -> List[SafeGlobal]:
    """The classes mmengine checkpoints carry besides tensors and builtins."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    safe: List[SafeGlobal] = [HistoryBuffer, np.ndarray, np.dtype,
                              (_history_buffer_getattr, 'builtins.getattr')]
    # numpy pickles arrays through ``_reconstruct`` and scalars through ``scalar``; the module
    # moved from numpy.core to numpy._core in numpy 2, and a checkpoint names the module of the
    # numpy that wrote it: allow both names, whichever numpy is installed
    multiarray = None
    for modname in ('numpy._core.multiarray', 'numpy.core.multiarray'):
        try:
            multiarray = __import__(modname, fromlist=['_reconstruct', 'scalar'])
            break
        except ImportError:
            continue
    if multiarray is not None:
        safe += [(getattr(multiarray, fn), f'{modname}.multiarray.{fn}')
                 for modname in ('numpy._core', 'numpy.core') for fn in ('_reconstruct', 'scalar')]
    # dtypes are pickled by their class (numpy >= 1.25: numpy.dtypes.Float64DType, ...)
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        safe += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith('DType')
                 and isinstance(getattr(dtypes, n), type)]
    return safe


def register_safe_globals() -> Tuple[str, ...]:
    """Allow-list mmengine's checkpoint classes for ``torch.load(weights_only=True)``."""
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is None:  # torch < 2.4 has no weights_only default to fix
        return ()
    safe = mmengine_safe_globals()
    add(safe)
    return tuple(s[1] if isinstance(s, tuple) else f'{s.__module__}.{s.__qualname__}'
                 for s in safe)


# ----------------------------------------------------------------------------- mmengine's loaders
def safe_load_from_local(filename: str, map_location: Any = None) -> Any:
    """mmengine's local-file checkpoint loader, through :func:`load_trusted_or_weights_only`."""
    path = resolve_checkpoint_path(filename, source='--resume / load_from / the checkpoint path')
    return load_trusted_or_weights_only(path, map_location, filename)


def safe_load_from_http(filename: str, map_location: Any = None,
                        model_dir: Optional[str] = None, progress: bool = False) -> Any:
    """mmengine's URL checkpoint loader (same signature) with ``weights_only=True``.

    As mmengine does, rank 0 downloads first (into ``model_dir``, default torch hub's
    checkpoint cache) while the other ranks wait, then read the cached file."""
    from mmengine.dist import get_dist_info

    del progress  # downloads are quiet, as in resolve_checkpoint_path
    rank, world_size = get_dist_info()
    path = resolve_checkpoint_path(filename, model_dir) if rank == 0 else None
    if world_size > 1:
        torch.distributed.barrier()
        if rank > 0:
            path = resolve_checkpoint_path(filename, model_dir)
    assert path is not None  # every rank resolved it
    return load_trusted_or_weights_only(path, map_location, filename)


def install_safe_checkpoint_loader() -> None:
    """Route mmengine's loading of local checkpoint files and URLs through
    :func:`safe_load_from_local` / :func:`safe_load_from_http` (idempotent)."""
    import mmengine.runner.checkpoint as mmengine_checkpoint
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes='', force=True)(safe_load_from_local)
    CheckpointLoader.register_scheme(prefixes=('http://', 'https://'),
                                     force=True)(safe_load_from_http)
    # modelzoo://, torchvision://, open-mmlab:// and mmcls:// resolve to a URL and call the
    # module-level load_from_http directly, not through the registry
    mmengine_checkpoint.load_from_http = safe_load_from_http
