"""Runtime compatibility checks and fixes, applied once when ``vitdet_plugin`` is imported.

* The supported stack is checked (mmcv, mmengine, mmdet versions, and that ``mmcv.ops`` loads:
  on mmcv's compiled extension or on the compile-free ops of :mod:`vitdet_plugin.ops`); a broken
  one raises :class:`UnsupportedEnvironmentError` naming the fix (``make env``) instead of
  failing later deep inside a model build.
* torch >= 2.6 loads checkpoints with ``weights_only=True`` by default, and mmengine 0.10.7's
  resume then fails on the objects its checkpoints carry (``HistoryBuffer`` in the message hub,
  its statistics methods, numpy arrays and scalars; mmengine#1655). We allow-list exactly
  those with
  :func:`torch.serialization.add_safe_globals`; ``weights_only`` stays on, so a checkpoint
  carrying any other object is still refused.
* mmcv 2.1's compiled ``nms`` and ``roi_align`` have no bfloat16 kernels (CPU: float only;
  CUDA: float and half), so bf16 autocast (``AmpOptimWrapper(dtype='bfloat16')``, and CPU
  autocast, which is bf16) fails in two-stage detectors' RPN NMS and RoI feature extraction.
  With the compiled extension, :func:`patch_mmcv_bf16_ops` runs those two ops in float32 for
  bf16 inputs and casts the result back; other dtypes go to mmcv's kernels unchanged. The
  compile-free ops take bf16 themselves, so nothing is patched on them.
"""
import functools
import importlib
import os
import pickle
from typing import Any, Callable, List, Tuple, Union

import torch

MMCV_RANGE = ('2.0.0rc4', '2.2.0')
MMENGINE_RANGE = ('0.10.0', '0.11.0')
MMDET_RANGE = ('3.0.0', '3.4.0')
FIX_HINT = ('run `make env` in the vitdet_plugin checkout (mmcv-lite 2.1.0 with the plugin\'s '
            'compile-free ops; `make env MMCV=compiled` builds mmcv 2.1.0 with its own ops)')
#: ``ops_backend()`` for mmcv's own compiled extension.
COMPILED_BACKEND = 'compiled'


class UnsupportedEnvironmentError(ImportError):
    """The installed OpenMMLab stack cannot run vitdet_plugin."""


def _version_in(version: str, lo: str, hi: str) -> bool:
    from packaging.version import parse
    return parse(lo) <= parse(version) < parse(hi)


def check_stack() -> None:
    """Raise :class:`ImportError` with the fix when mmcv/mmengine/mmdet are unusable."""
    try:
        import mmcv
        import mmdet
        import mmengine
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedEnvironmentError(f'vitdet_plugin needs mmcv, mmengine and mmdet: {e}; '
                                          f'{FIX_HINT}') from e
    for name, module, (lo, hi) in (('mmcv', mmcv, MMCV_RANGE),
                                   ('mmengine', mmengine, MMENGINE_RANGE),
                                   ('mmdet', mmdet, MMDET_RANGE)):
        if not _version_in(module.__version__, lo, hi):
            raise UnsupportedEnvironmentError(
                f'{name} {module.__version__} is not supported: vitdet_plugin needs '
                f'{lo} <= {name} < {hi}; {FIX_HINT}')
    try:
        from mmcv.ops import nms  # noqa: F401  (loads the extension: compiled or ours)
    except (ImportError, ModuleNotFoundError, OSError) as e:
        raise UnsupportedEnvironmentError(
            f'mmcv {mmcv.__version__} cannot load mmcv.ops (no compiled extension, and the '
            f'compile-free ops are off or not installed: VITDET_MMCV_OPS='
            f'{os.environ.get("VITDET_MMCV_OPS", "auto")}): {e}; {FIX_HINT}') from e


def ops_backend() -> str:
    """What runs mmcv's ops: ``'compiled'`` (mmcv's extension) or ``'vitdet_plugin.ops'``."""
    ext = importlib.import_module('mmcv._ext')
    return str(getattr(ext, 'BACKEND', COMPILED_BACKEND))


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


def apply() -> None:
    """Check the stack and install the fixes (idempotent)."""
    check_stack()
    register_safe_globals()
    if ops_backend() == COMPILED_BACKEND:
        patch_mmcv_bf16_ops()
