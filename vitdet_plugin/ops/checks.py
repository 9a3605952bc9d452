"""Input checks shared by the compile-free ops: one error type, messages that name the op.

mmcv's compiled kernels read raw pointers: a CPU ``rois`` next to a CUDA ``input``, a float64
``offset`` next to a float32 ``input`` or a 3-d map either crash the process or compute garbage.
The compile-free ops check first and raise :class:`OpInputError` naming the op, the argument,
what it must be and what it was.
"""
from typing import Optional, Sequence, Tuple

import torch

#: dtypes the compile-free kernels accept for feature maps, boxes and logits.
FLOATING: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: dtypes accepted for class-index targets (mmcv asserts ``torch.long`` in its wrappers).
INDEX: Tuple[torch.dtype, ...] = (torch.int64,)


class OpInputError(ValueError):
    """Bad input to a compile-free mmcv op (``vitdet_plugin.ops``)."""


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ' / '.join(str(d).replace('torch.', '') for d in dtypes)


def check_tensor(op: str, name: str, tensor: object, *, ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None,
                 dtypes: Sequence[torch.dtype] = FLOATING, what: str = '') -> torch.Tensor:
    """Check one argument of ``op`` and return it.

    ``shape`` may hold ``None`` for sizes left free (``(None, 5)``: K x 5); ``what`` describes
    the layout in the message (``'(K, 5) = (batch index, x1, y1, x2, y2)'``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise OpInputError(f'{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}')
    layout = f' {what}' if what else ''
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and tensor.dim() != ndim:
        raise OpInputError(f'{op}: {name} must be {ndim}-d{layout}, got shape '
                           f'{tuple(tensor.shape)}')
    if shape is not None and any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        want = ', '.join('*' if s is None else str(s) for s in shape)
        raise OpInputError(f'{op}: {name} must have shape ({want}){layout}, got '
                           f'{tuple(tensor.shape)}')
    if tensor.dtype not in dtypes:
        raise OpInputError(f'{op}: {name} must be {_dtype_names(dtypes)}, got '
                           f'{str(tensor.dtype).replace("torch.", "")}')
    return tensor


def check_same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    """All ``tensors`` on one device (named in the message when they are not); returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ', '.join(f'{n} on {d}' for n, d in devices.items())
        raise OpInputError(f'{op}: all tensors must be on one device, got {listed}; move them '
                           f'with .to(device)')
    return first


def check_same_dtype(op: str, **tensors: torch.Tensor) -> torch.dtype:
    """All ``tensors`` of one dtype (named in the message when they are not); returns it."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    if any(d != first for d in dtypes.values()):
        listed = ', '.join(f'{n} {str(d).replace("torch.", "")}' for n, d in dtypes.items())
        raise OpInputError(f'{op}: all tensors must have one dtype, got {listed}; cast them '
                           f'with .to(dtype)')
    return first
