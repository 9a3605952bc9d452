"""Every change ``import vitdet_plugin`` makes to other libraries, applied by one function,
:func:`apply` (called from ``vitdet_plugin/__init__.py``; idempotent). Importing this module
changes nothing. In order:

1. The compile-free mmcv ops are put in place where mmcv has no compiled extension
   (:func:`vitdet_plugin.ops.startup.install`; the package's .pth hook does the same at
   interpreter start), before anything imports ``mmcv.ops``.
2. The supported stack is checked (mmcv, mmengine, mmdet versions, and that ``mmcv.ops`` loads:
   on mmcv's compiled extension or on the compile-free ops of :mod:`vitdet_plugin.ops`); a broken
   one raises :class:`UnsupportedEnvironmentError` naming the fix (``make env``) instead of
   failing later deep inside a model build. Two stacks are supported, each with its own version
   ranges (:func:`installed_stack` tells them apart): OpenMMLab's last releases, and the
   maintained fork (onedl-mmdetection, onedl-mmengine, onedl-mmcv; ``make env STACK=onedl``).
3. Safe checkpoint loading (the readers of :mod:`vitdet_plugin.weights.checkpoint_io`):

   * **mmengine's checkpoints under weights_only.** torch >= 2.6 loads with
     ``weights_only=True`` by default, and mmengine 0.10.7's resume then fails on the objects
     its checkpoints carry (``HistoryBuffer`` in the message hub, its statistics methods, numpy
     arrays and scalars; mmengine#1655). :func:`register_safe_globals` allow-lists exactly those
     with :func:`torch.serialization.add_safe_globals`; ``weights_only`` stays on.
   * **mmengine's loaders.** :func:`install_safe_checkpoint_loader` makes mmengine's loaders
     for local files and for URLs (``http(s)://``, and through it ``modelzoo://``,
     ``torchvision://``, ``open-mmlab://``, ``mmcls://``), used by ``Runner.resume``
     (``tools/train.py --resume``), ``load_from`` and ``load_checkpoint``, read through
     :func:`~vitdet_plugin.weights.checkpoint_io.load_trusted_or_weights_only` with its trust
     list (mmengine's own URL loader goes through torch hub's ``load_state_dict_from_url``,
     which unpickles anything); an RF-DETR file reads as our detector's checkpoint, and what
     they load is checked against the model first (:mod:`vitdet_plugin.weights.model_load`).
4. mmcv 2.1's compiled ``nms`` and ``roi_align`` have no bfloat16 kernels (CPU: float only;
   CUDA: float and half), so bf16 autocast (``AmpOptimWrapper(dtype='bfloat16')``, and CPU
   autocast, which is bf16) fails in two-stage detectors' RPN NMS and RoI feature extraction.
   With the compiled extension, :func:`patch_mmcv_bf16_ops` runs those two ops in float32 for
   bf16 inputs and casts the result back; other dtypes go to mmcv's kernels unchanged. The
   compile-free ops take bf16 themselves, so nothing is patched on them.

Registering our modules in mmdet's and mmengine's registries is separate: importing
:mod:`vitdet_plugin.models`, :mod:`vitdet_plugin.engine` and :mod:`vitdet_plugin.checks` does it.
"""
import functools
import importlib
import importlib.metadata
import os
import pickle
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from .ops import startup as ops_startup
from .weights.checkpoint_io import (CheckpointError, load_trusted_or_weights_only,
                                    resolve_checkpoint_path)
from .weights import model_load
from .weights.rfdetr import as_detector_checkpoint, folder_detector_checkpoint
from .weights.dfine_detector import dfine_detector_layout
from .weights.dfine_official import official_detector_state
from .weights.transformers_folder import (is_transformers_folder, load_transformers_folder,
                                          read_transformers_config)

MMCV_RANGE = ('2.0.0rc4', '2.2.0')
MMENGINE_RANGE = ('0.10.0', '0.11.0')
MMDET_RANGE = ('3.0.0', '3.4.0')
FIX_HINT = ('run `make env` in the vitdet_plugin checkout (mmcv-lite 2.1.0 with the plugin\'s '
            'compile-free ops; `make env MMCV=compiled` builds mmcv 2.1.0 with its own ops)')
#: The distribution of the maintained fork's mmdet: installed, it selects :data:`ONEDL`.
ONEDL_MMDET_DISTRIBUTION = 'onedl-mmdetection'
ONEDL_FIX_HINT = ('run `make env STACK=onedl` in the vitdet_plugin checkout (onedl-mmengine, '
                  'onedl-mmcv without its extension and the plugin\'s compile-free ops, '
                  'onedl-mmdetection)')


class Stack(NamedTuple):
    """A supported mmcv / mmengine / mmdet combination: a half-open version range per package
    (``lo <= version < hi``) and the command that installs it."""
    name: str
    ranges: Dict[str, Tuple[str, str]]
    fix_hint: str


#: OpenMMLab's last releases (mmdet 3.3 refuses mmcv >= 2.2).
OPENMMLAB = Stack('openmmlab', {'mmcv': MMCV_RANGE, 'mmengine': MMENGINE_RANGE,
                                'mmdet': MMDET_RANGE}, FIX_HINT)
#: The maintained fork (onedl-mmcv 2.3, onedl-mmengine 0.10.8+, onedl-mmdetection 3.5), which
#: imports as mmcv / mmengine / mmdet.
ONEDL = Stack('onedl', {'mmcv': ('2.3.0', '2.4.0'), 'mmengine': ('0.10.8', '0.11.0'),
                        'mmdet': ('3.5.0', '3.6.0')}, ONEDL_FIX_HINT)
#: ``ops_backend()`` for mmcv's own compiled extension.
COMPILED_BACKEND = 'compiled'


class UnsupportedEnvironmentError(ImportError):
    """The installed OpenMMLab stack cannot run vitdet_plugin."""


def _version_in(version: str, lo: str, hi: str) -> bool:
    from packaging.version import parse
    return parse(lo) <= parse(version) < parse(hi)


def installed_stack() -> Stack:
    """:data:`ONEDL` where the fork's mmdet distribution is installed, else :data:`OPENMMLAB`."""
    try:
        importlib.metadata.version(ONEDL_MMDET_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return OPENMMLAB
    return ONEDL


def check_stack() -> None:
    """Raise :class:`ImportError` with the fix when mmcv/mmengine/mmdet are unusable."""
    stack = installed_stack()
    try:
        import mmcv
        import mmdet
        import mmengine
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedEnvironmentError(f'vitdet_plugin needs mmcv, mmengine and mmdet: {e}; '
                                          f'{stack.fix_hint}') from e
    for name, module in (('mmcv', mmcv), ('mmengine', mmengine), ('mmdet', mmdet)):
        lo, hi = stack.ranges[name]
        if not _version_in(module.__version__, lo, hi):
            raise UnsupportedEnvironmentError(
                f'{name} {module.__version__} is not supported: vitdet_plugin needs '
                f'{lo} <= {name} < {hi}; {stack.fix_hint}')
    try:
        from mmcv.ops import nms  # noqa: F401  (loads the extension: compiled or ours)
    except (ImportError, ModuleNotFoundError, OSError) as e:
        raise UnsupportedEnvironmentError(
            f'mmcv {mmcv.__version__} cannot load mmcv.ops (no compiled extension, and the '
            f'compile-free ops are off or not installed: VITDET_MMCV_OPS='
            f'{os.environ.get("VITDET_MMCV_OPS", "auto")}): {e}; {stack.fix_hint}') from e


def ops_backend() -> str:
    """What runs mmcv's ops: ``'compiled'`` (mmcv's extension) or ``'vitdet_plugin.ops'``."""
    ext = importlib.import_module('mmcv._ext')
    return str(getattr(ext, 'BACKEND', COMPILED_BACKEND))


_BF16_PATCHED = '_vitdet_bf16_via_fp32'


def _nms_bf16_via_fp32(nms: Callable) -> Callable:
    @functools.wraps(nms)
    def wrapped(boxes, scores, iou_threshold, offset=0, score_threshold=0, max_num=-1):
        if isinstance(boxes, torch.Tensor) and torch.bfloat16 in (boxes.dtype, scores.dtype):
            dets, inds = nms(boxes.float(), scores.float(), iou_threshold, offset,
                             score_threshold, max_num)
            return dets.to(boxes.dtype), inds
        return nms(boxes, scores, iou_threshold, offset, score_threshold, max_num)
    setattr(wrapped, _BF16_PATCHED, True)
    return wrapped


def _roi_align_bf16_via_fp32(roi_align: Callable) -> Callable:
    @functools.wraps(roi_align)
    def wrapped(input, rois, *args):
        if torch.bfloat16 in (input.dtype, rois.dtype):
            return roi_align(input.float(), rois.float(), *args).to(input.dtype)
        return roi_align(input, rois, *args)
    setattr(wrapped, _BF16_PATCHED, True)
    return wrapped


def patch_mmcv_bf16_ops() -> None:
    """Run mmcv's ``nms`` (and through it ``batched_nms``) and ``roi_align`` (``RoIAlign``) in
    float32 for bfloat16 inputs (idempotent). ``batched_nms`` and ``RoIAlign`` look the op up
    as a module global at call time, which is replaced, as is the ``mmcv.ops`` attribute (a
    module that bound ``from mmcv.ops import nms`` before importing vitdet_plugin keeps mmcv's
    own)."""
    ops = importlib.import_module('mmcv.ops')
    for module_name, name, wrap in (('mmcv.ops.nms', 'nms', _nms_bf16_via_fp32),
                                    ('mmcv.ops.roi_align', 'roi_align',
                                     _roi_align_bf16_via_fp32)):
        module = importlib.import_module(module_name)
        op = getattr(module, name)
        if not getattr(op, _BF16_PATCHED, False):
            op = wrap(op)
            setattr(module, name, op)
        setattr(ops, name, op)  # `from mmcv.ops import nms` after this import gets it too


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
    """mmengine's local-file checkpoint loader, through :func:`load_trusted_or_weights_only`;
    a transformers model folder (``save_pretrained``; RF-DETR's with its ``id2label`` classes)
    and an official D-FINE / DEIMv2 file are read as their detector state dict (the model
    check converts it, :mod:`.weights.model_load`)."""
    if is_transformers_folder(filename):
        state = load_transformers_folder(filename, map_location or 'cpu')
        rfdetr = folder_detector_checkpoint(state, read_transformers_config(filename))
        if rfdetr is not None:
            return rfdetr
        if dfine_detector_layout(state) is None:
            raise CheckpointError(
                f'{filename!r} is a transformers folder but no DFineForObjectDetection / '
                'Deimv2ForObjectDetection / RfDetrForObjectDetection / '
                'RfDetrForInstanceSegmentation: only those load as a whole detector; give a '
                "backbone's folder to the backbone's init_cfg=dict(type='Pretrained', "
                'checkpoint=FOLDER), or convert it with tools/convert_weights.py')
        return {'state_dict': state}
    path = resolve_checkpoint_path(filename, source='--resume / load_from / the checkpoint path')
    ckpt = load_trusted_or_weights_only(path, map_location, filename)
    official = official_detector_state(ckpt)
    if official is not None:  # the model check converts it (EMAHook reads 'state_dict')
        return {'state_dict': official}
    return as_detector_checkpoint(ckpt)  # an RF-DETR file: in our detector's names


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
    ckpt = load_trusted_or_weights_only(path, map_location, filename)
    return as_detector_checkpoint(ckpt)


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
    model_load.install()  # what they read is checked against the model before it loads


def apply() -> None:
    """Apply the import-time patches listed in the module docstring, in that order
    (idempotent)."""
    ops_startup.install()  # before anything below imports mmcv.ops
    check_stack()
    register_safe_globals()
    install_safe_checkpoint_loader()
    if ops_backend() == COMPILED_BACKEND:
        patch_mmcv_bf16_ops()
