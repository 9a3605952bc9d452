"""Checkpoints read lazily: tensors backed by a memory map of the file, for loading a large
pretrained model shard by shard (``FSDP2Wrapper(init_device='meta')``).

:func:`read_lazily` gives the tensors of a file without reading their bytes: a
``.safetensors`` file through ``safetensors.safe_open`` (its tensors are zero-copy views of the
file's map), a ``.pth`` / ``.pt`` / ``.bin`` through ``torch.load(mmap=True,
weights_only=True)``. The layout table's converters take such a dict as they take any other:
renaming and reshaping keep the views (no byte is read), only a tensor a converter computes
(a resampled position grid or patch kernel, a concatenated SwiGLU, a dtype cast) is
materialised. A page of the file is read when a shard is copied out of it;
:meth:`LazyCheckpoint.release` drops a tensor's pages from the process again
(``madvise(MADV_DONTNEED)`` on the file map: clean pages, re-read on a later access), so the
resident set holds one tensor of the file at a time, not the whole file.

Anything else (a transformers folder, a detectron2 ``.pkl``, a legacy non-zip ``.pth``, a
file listed in ``VITDET_TRUSTED_CHECKPOINTS``) is read whole by :mod:`.checkpoint_io`'s
readers, with a warning saying so.
"""
import ctypes
import logging
import mmap
import os
import pickle
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from .checkpoint_io import (CheckpointError, is_trusted, load_trusted_or_weights_only,
                            resolve_checkpoint_path)
from .common import load_checkpoint_file
from .transformers_folder import is_transformers_folder

logger = logging.getLogger('vitdet_plugin')

#: file suffixes read through a memory map
SAFETENSORS = '.safetensors'
TORCH_SAVE = ('.pth', '.pt', '.bin')
#: ``madvise`` of the C library (None where there is none, e.g. Windows): pages are then kept
_MADVISE = getattr(ctypes.CDLL(None), 'madvise', None) if os.name == 'posix' else None
if _MADVISE is not None:
    _MADVISE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_DONTNEED = getattr(mmap, 'MADV_DONTNEED', None)

Span = Tuple[int, int]


class LazyCheckpoint:
    """The tensors of a checkpoint file (:attr:`tensors`; the checkpoint dict as saved, the
    tensors memory-mapped where the format allows) and the address ranges of its file maps."""

    def __init__(self, tensors: Mapping, spans: List[Span]) -> None:
        self.tensors = tensors
        self._spans = sorted(spans)

    @property
    def mapped(self) -> bool:
        """Whether the tensors are views of a file map (else they were read whole)."""
        return bool(self._spans)

    def release(self, tensor: Tensor) -> None:
        """Drop the pages of ``tensor`` from the resident set when it is a view of the file
        map (a tensor a converter computed is left alone: its memory goes when it is freed).
        Only whole pages inside the tensor's bytes are dropped."""
        if _MADVISE is None or _DONTNEED is None or not self._spans or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self._spans):
            return
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            _MADVISE(first, last - first, _DONTNEED)


def _span(tensor: Tensor) -> Span:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _tensors(node: object) -> List[Tensor]:
    if isinstance(node, Tensor):
        return [node]
    if isinstance(node, Mapping):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


def _read_safetensors(path: str) -> Dict[str, Tensor]:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError(f'{path!r} is a safetensors file; install the safetensors '
                              'package (pip install safetensors) to read it') from e
    with safe_open(path, framework='pt', device='cpu') as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _read_torch_save(path: str, given: str) -> Optional[dict]:
    """``torch.load(mmap=True, weights_only=True)``; None when the file cannot be mapped (a
    legacy non-zip file) or is refused (the safe reader then reads it or names the refusal)."""
    if is_trusted(path, given):
        return None
    try:
        return torch.load(path, map_location='cpu', mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError):
        return None


def read_lazily(checkpoint: Union[str, os.PathLike]) -> LazyCheckpoint:
    """The checkpoint at ``checkpoint`` (a path or URL), memory-mapped where the format allows
    (see the module docstring); otherwise read whole through the safe readers."""
    given = os.fspath(checkpoint)
    if not is_transformers_folder(given):
        path = resolve_checkpoint_path(given)
        loaded: Optional[Mapping] = None
        if path.endswith(SAFETENSORS):
            loaded = _read_safetensors(path)
        elif path.endswith(TORCH_SAVE):
            loaded = _read_torch_save(path, given)
        if loaded is not None:
            return LazyCheckpoint(loaded, [_span(t) for t in _tensors(loaded)])
        if path.endswith(TORCH_SAVE):  # refused, trusted or legacy: the safe reader decides
            whole = load_trusted_or_weights_only(path, 'cpu', given)
            logger.warning('%s cannot be memory-mapped (legacy format or trusted file): read '
                           'whole', given)
            return LazyCheckpoint(whole, [])
    logger.warning('%s is read whole (only .safetensors and zip .pth files are '
                   'memory-mapped)', given)
    return LazyCheckpoint(load_checkpoint_file(given), [])
