"""The one switch for our CPU kernels, and where they run.

Backbones take ``accel='auto' | 'off'``. With ``'auto'`` the kernels of this package run only
where they were measured to help: on the CPU (``tools/benchmark.py``; README "Speed and
memory"). Everywhere else (CUDA and other accelerators, the meta device, ``'off'``, and
while ``torch.export`` / an ONNX exporter / ``torch.jit.trace`` records a graph) the model's
plain path runs: ``F.scaled_dot_product_attention`` with the bias as ``attn_mask``, no
chunking, no host syncs. Under ``torch.compile`` on the CPU the plan says ``compiled``: the
attention training kernel (a custom op, :mod:`.recompute`) stays in the compiled graphs, the
window projections skip padding tokens (:func:`.runners.padding_free_window_attention`) and
the GELU recompute is a checkpointed region; the chunked inference loop (in-place writes into
one buffer) does not run, the compiler fuses the plain inference path itself. The parity tests
(``tests/test_accel.py``, ``tests/test_compile.py``) are the contract between the paths.
"""
from typing import NamedTuple

import torch
from torch import Tensor

#: Accepted values of the ``accel`` switch.
ACCEL_MODES = ('auto', 'off')
#: Device types whose accelerated kernels were measured to win (README "Speed and memory").
ACCELERATED_DEVICE_TYPES = ('cpu',)


def check_accel(mode: object) -> str:
    """``mode`` if it is one of :data:`ACCEL_MODES`, else a ``ValueError`` naming the choices."""
    if not isinstance(mode, str) or mode not in ACCEL_MODES:
        raise ValueError(f'accel={mode!r} is not supported; choose one of {list(ACCEL_MODES)} '
                         "('auto': our CPU kernels on CPU, the plain path elsewhere; 'off': "
                         'the plain path everywhere)')
    return mode


class AccelPlan(NamedTuple):
    """Which accelerated kernels a forward uses.

    ``chunked_inference``: Swin inference on a flat token buffer updated in place, in chunks
    of windows (no full-size temporaries); ``recompute_attention``: attention whose backward
    recomputes the probabilities instead of keeping them (a bias that needs a gradient);
    ``recompute_gelu``: an MLP whose backward recomputes its GELU instead of keeping it;
    ``compiled``: ``torch.compile`` is tracing the forward, so formulations the compiler fuses
    better are used (window attention projects only the image tokens,
    :func:`.runners.padding_free_window_attention`; the GELU recompute is a checkpointed
    region the compiler rematerialises inside its fused backward kernel, not the eager
    kernel's custom op).
    """
    chunked_inference: bool
    recompute_attention: bool
    recompute_gelu: bool
    compiled: bool = False


PLAIN = AccelPlan(False, False, False)


def plan_for(device_type: str, mode: str, grad_enabled: bool, autocast: bool) -> AccelPlan:
    """The kernels used on ``device_type`` (``'cpu'``, ``'cuda'``, ``'meta'``, ...) under
    ``mode``, with autograd recording (``grad_enabled``) or not and autocast on or off.

    Inference kernels write into buffers of the input's dtype, so they stay off under autocast
    (the plain path then gives every op autocast's dtype exactly as eager PyTorch does).
    """
    if check_accel(mode) == 'off' or device_type not in ACCELERATED_DEVICE_TYPES:
        return PLAIN
    if not grad_enabled:
        return AccelPlan(chunked_inference=not autocast, recompute_attention=False,
                         recompute_gelu=False)
    return AccelPlan(chunked_inference=False, recompute_attention=not autocast,
                     recompute_gelu=not autocast)


def exporting_graph() -> bool:
    """True while ``torch.export`` (hence the dynamo ONNX exporter), TorchScript tracing or the
    TorchScript ONNX exporter records the forward: graphs meant to leave PyTorch, which hold
    only standard ops. (A torch without ``torch.compiler.is_exporting`` counts every compile.)"""
    is_exporting = getattr(torch.compiler, 'is_exporting', torch.compiler.is_compiling)
    return (is_exporting() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export())


def capturing_graph() -> bool:
    """True while ``torch.compile`` or any exporter of :func:`exporting_graph` records the
    forward."""
    return torch.compiler.is_compiling() or exporting_graph()


def plan_for_tensor(x: Tensor, mode: str) -> AccelPlan:
    """:func:`plan_for` the device of ``x`` in the current grad / autocast state.

    While a graph is exported (:func:`exporting_graph`) the plain path runs on every device.
    Under ``torch.compile`` (on a device and in a mode with any kernel) the plan says
    ``compiled``: the attention training kernel (a custom op with registered backward and fake
    implementations) is kept, the GELU recompute and the window projections take their
    compiler-friendly forms, and the chunked inference loop is dropped (in-place writes into a
    buffer, which the compiler would only copy around; it fuses the plain path itself).
    """
    if exporting_graph():
        return PLAIN
    device_type = x.device.type
    autocast = device_type != 'meta' and torch.is_autocast_enabled(device_type)
    plan = plan_for(device_type, mode, torch.is_grad_enabled(), autocast)
    if (torch.compiler.is_compiling() and mode != 'off'
            and device_type in ACCELERATED_DEVICE_TYPES):
        plan = plan._replace(chunked_inference=False, compiled=True)
    return plan
