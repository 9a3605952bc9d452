"""Run an exported graph in onnxruntime: parity with PyTorch per input size, and latency."""
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from .onnx_export import INPUT_NAME

#: Default largest ``max |onnx - torch| / max |torch|`` per output (fp32 on both sides).
DEFAULT_TOLERANCE = 1e-4
#: Default check sizes: none a multiple of a patch (4, 8, 16), a window (7, 12, 14) or 32.
CHECK_SIZES: Tuple[Tuple[int, int], ...] = ((200, 312), (480, 640), (801, 1217))
#: Seed of the random check images.
CHECK_SEED = 0


@dataclass(frozen=True)
class SizeCheck:
    """onnxruntime vs PyTorch at one input size."""

    size: Tuple[int, int]
    batch: int
    errors: Tuple[float, ...]          # per output, relative to the PyTorch output's max
    shapes: Tuple[Tuple[int, ...], ...]

    @property
    def max_error(self) -> float:
        return max(self.errors)


@dataclass(frozen=True)
class Latency:
    """Median seconds of one forward: onnxruntime and PyTorch (eval, no grad), same input."""

    size: Tuple[int, int]
    batch: int
    onnxruntime: float
    torch: float

    @property
    def ratio(self) -> float:
        """onnxruntime / PyTorch (< 1: onnxruntime is faster)."""
        return self.onnxruntime / self.torch


#: onnxruntime's session option that keeps its idle pool threads spinning after a run.
SPINNING = 'session.intra_op.allow_spinning'


#: onnxruntime's log severity that shows errors only.
ORT_ERRORS_ONLY = 3


def ort_session(path: Union[str, bytes], spinning: bool = True, quiet: bool = False):
    """A CPU onnxruntime session of ``path`` (a file, or the model's bytes; a clear error when
    onnxruntime is missing). ``spinning=False``: its idle pool threads do not spin after a run
    (when a PyTorch run is timed right after it, on the same cores). ``quiet``: errors only in
    its log (an overridden initializer draws a warning at every load)."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise SystemExit(f'checking the export needs onnxruntime ({e}): pip install -e '
                         '".[deploy]" (or `make env`)') from e
    options = ort.SessionOptions()
    # the check times both engines on the same cores: onnxruntime gets torch's thread count
    # (its own default is every core, whatever this process was given)
    options.intra_op_num_threads = torch.get_num_threads()
    if not spinning:
        options.add_session_config_entry(SPINNING, '0')
    if quiet:
        options.log_severity_level = ORT_ERRORS_ONLY
    return ort.InferenceSession(path, options, providers=['CPUExecutionProvider'])


def _image(batch: int, channels: int, size: Tuple[int, int]) -> Tensor:
    g = torch.Generator().manual_seed(CHECK_SEED)
    return torch.randn(batch, channels, *size, generator=g)


def _rel_err(out: np.ndarray, ref: Tensor) -> float:
    ref64 = ref.double()
    diff = (torch.from_numpy(out).double() - ref64).abs().max()
    return float(diff / ref64.abs().max().clamp_min(1e-12))


def check_sizes(session, module: nn.Module, channels: int, sizes: Sequence[Tuple[int, int]],
                batch: int = 1) -> List[SizeCheck]:
    """Compare ``session`` with ``module`` (eval, no grad) on a random image per size."""
    module.eval()
    checks = []
    for size in sizes:
        x = _image(batch, channels, size)
        with torch.no_grad():
            refs = module(x)
        outs = session.run(None, {INPUT_NAME: x.numpy()})
        if len(outs) != len(refs):
            raise RuntimeError(f'the ONNX graph gives {len(outs)} outputs at {size}, PyTorch '
                               f'{len(refs)}')
        for o, r in zip(outs, refs):
            if tuple(o.shape) != tuple(r.shape):
                raise RuntimeError(f'output shape {tuple(o.shape)} differs from PyTorch\'s '
                                   f'{tuple(r.shape)} at input {size}: the graph is not '
                                   'dynamic in height/width')
        checks.append(SizeCheck(size=(size[0], size[1]), batch=batch,
                                errors=tuple(_rel_err(o, r) for o, r in zip(outs, refs)),
                                shapes=tuple(tuple(o.shape) for o in outs)))
    return checks


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency(session, module: nn.Module, channels: int, size: Tuple[int, int], batch: int = 1,
            repeats: int = 5, warmup: int = 1) -> Latency:
    """Median wall seconds of onnxruntime and of the PyTorch module (eval, no grad, our CPU
    kernels as in eager use), alternating, on one random image."""
    module.eval()
    x = _image(batch, channels, size)
    feed = {INPUT_NAME: x.numpy()}

    def run_torch() -> object:
        with torch.no_grad():
            return module(x)

    def run_ort() -> object:
        return session.run(None, feed)

    ort_times, torch_times = [], []
    for _ in range(warmup):
        run_ort()
        run_torch()
    for _ in range(repeats):  # interleaved: both see the same machine load
        ort_times.append(_seconds(run_ort))
        torch_times.append(_seconds(run_torch))
    return Latency(size=(size[0], size[1]), batch=batch, onnxruntime=statistics.median(ort_times),
                   torch=statistics.median(torch_times))
