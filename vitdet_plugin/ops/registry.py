"""Which ``mmcv._ext`` functions the compile-free backend implements, and where.

mmcv's Python ops (``mmcv.ops.nms``, ``RoIAlign``, ``MultiScaleDeformableAttention``, ...) call
their compiled extension, ``mmcv._ext``, with a fixed signature per function (tensors to write
into included). :data:`IMPLEMENTED` maps each function this backend provides to the module of
``vitdet_plugin.ops`` that holds it, with the same signature; every other name of the extension
resolves to a function that raises :class:`MissingCompiledOpError`, naming the op and the fix.
"""
import importlib
from typing import Any, Callable, Dict, NoReturn

#: ``mmcv._ext`` function name -> module of ``vitdet_plugin.ops`` that implements it.
IMPLEMENTED: Dict[str, str] = {
    'get_compiler_version': 'info',
    'get_compiling_cuda_version': 'info',
    'nms': 'nms',
    'softnms': 'nms',
    'nms_match': 'nms',
    'bbox_overlaps': 'bbox',
    'roi_align_forward': 'roi',
    'roi_align_backward': 'roi',
    'roi_pool_forward': 'roi',
    'roi_pool_backward': 'roi',
    'deform_conv_forward': 'deform_conv',
    'deform_conv_backward_input': 'deform_conv',
    'deform_conv_backward_parameters': 'deform_conv',
    'modulated_deform_conv_forward': 'deform_conv',
    'modulated_deform_conv_backward': 'deform_conv',
    'sigmoid_focal_loss_forward': 'focal_loss',
    'sigmoid_focal_loss_backward': 'focal_loss',
    'softmax_focal_loss_forward': 'focal_loss',
    'softmax_focal_loss_backward': 'focal_loss',
    'ms_deform_attn_forward': 'deform_attn',
    'ms_deform_attn_backward': 'deform_attn',
}

#: How to get the ops this backend lacks (README: "Install").
COMPILED_FIX = ('install mmcv with compiled ops: `make env MMCV=compiled` in the vitdet_plugin '
                'checkout (builds mmcv 2.1.0 from its sdist; needs g++ and the Python headers)')


class MissingCompiledOpError(NotImplementedError):
    """An ``mmcv._ext`` function that only compiled mmcv has."""


def missing(name: str) -> Callable[..., NoReturn]:
    """A stand-in for ``mmcv._ext.<name>`` that raises, naming the op and the fix."""
    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise MissingCompiledOpError(
            f'mmcv op {name!r} (mmcv._ext.{name}) is not in the compile-free backend of '
            f'vitdet_plugin (it provides: {", ".join(sorted(IMPLEMENTED))}); {COMPILED_FIX}')
    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def resolve(name: str) -> Callable[..., Any]:
    """The implementation of ``mmcv._ext.<name>``: ours, or one that raises."""
    module = IMPLEMENTED.get(name)
    if module is None:
        return missing(name)
    return getattr(importlib.import_module(f'{__package__}.{module}'), name)
