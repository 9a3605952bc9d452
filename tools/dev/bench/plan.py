"""What a benchmark run does on a device: defaults, timer, precision and memory measure.

Everything here is decided from the device string alone, without touching the device, so the
CUDA choices can be checked on a machine without a GPU (``plan_for('cuda', 'swin')``).
"""
import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch

Size = Tuple[int, int]

#: Models the benchmark compares (ours against each reference); ``ops``: the compile-free mmcv
#: ops against compiled mmcv (``tools/dev/bench/ops.py``).
MODELS = ('swin', 'swinv2', 'vit', 'dinov2', 'dinov3', 'eva02', 'ops')
#: Plain ViTs, benchmarked at :data:`VIT_SIZES`.
PLAIN_VITS = ('vit', 'dinov2', 'dinov3', 'eva02')
#: Default ``--arch`` per model.
DEFAULT_ARCH: Dict[str, str] = {'swin': 'tiny', 'swinv2': 'tiny', 'vit': 'base',
                                'dinov2': 'base', 'dinov3': 'base', 'eva02': 'base',
                                'ops': 'mmcv'}
#: Compute precisions: fp32, or the forward (and backward) under bf16 autocast.
DTYPES = ('fp32', 'bf16')
#: Timing clocks: wall time, or process CPU time (all threads; CPU only).
CLOCKS = ('wall', 'cpu')
#: Memory columns: bytes autograd saves for backward, or the peak CUDA allocation.
SAVED_ACTIVATIONS = 'saved_activations'
PEAK_CUDA = 'peak_cuda'

#: Timed runs per measurement on CUDA: at least this many, after the warm-up.
MIN_CUDA_REPEATS = 10
#: Warm-up calls per model before timing on CUDA (cuDNN/cuBLAS autotuning, allocator growth).
CUDA_WARMUP = 3
#: Warm-up calls per model on CPU (first-touch page faults of the buffers).
CPU_WARMUP = 1
#: Timed runs per measurement on CPU (the README's figures).
CPU_REPEATS = 5
#: Fresh processes per row on CPU: the references' speed moves between processes on a shared
#: machine by more than the repeats within one show. On CUDA one process suffices.
CPU_PROCESSES = 3
#: Images per batch: 1 on CPU (the README's figures), 2 on CUDA (a detection training batch).
CPU_BATCH = 1
CUDA_BATCH = 2

SWIN_CPU_SIZES: Tuple[Size, ...] = ((224, 224), (800, 1216), (1024, 1024))
VIT_SIZES: Tuple[Size, ...] = ((1024, 1024), )
DETECTION_SIZE: Size = (800, 1216)
CPU_TRAIN_SIZE: Size = (512, 512)


def parse_size(text: str) -> Size:
    """``'800x1216'`` -> ``(800, 1216)``; ``'1024'`` -> ``(1024, 1024)``."""
    h, _, w = text.lower().partition('x')
    try:
        size = (int(h), int(w or h))
    except ValueError:
        raise ValueError(f'size {text!r} is not N or HxW (e.g. 1024 or 800x1216)') from None
    if min(size) < 1:
        raise ValueError(f'size {text!r} must be positive')
    return size


def size_text(size: Size) -> str:
    return f'{size[0]}x{size[1]}'


def device_type(device: str) -> str:
    """``'cuda'`` for ``'cuda:1'``; a ``ValueError`` naming the choices otherwise."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ('cpu', 'cuda'):
        raise ValueError(f'--device {device!r}: the benchmark runs on cpu, cuda or cuda:N')
    return kind


def is_cuda(device: str) -> bool:
    return device_type(device) == 'cuda'


@dataclass(frozen=True)
class DevicePlan:
    """How a benchmark is run on one device (defaults that the command line may override)."""

    device: str
    synchronize: bool            # torch.cuda.synchronize around every timed call
    memory: str                  # SAVED_ACTIVATIONS or PEAK_CUDA
    sizes: Tuple[Size, ...]      # forward sizes
    train_size: Size             # training forward+backward and memory size
    batch: int
    dtypes: Tuple[str, ...]
    repeats: int
    min_repeats: int             # timed runs below this are refused
    warmup: int
    processes: int               # fresh processes per row
    clocks: Tuple[str, ...]      # clocks that measure this device's work

    def train_repeats(self, repeats: int) -> int:
        """Timed training steps: on CPU half the forward repeats (they take ~3x longer), on
        CUDA as many as the forwards (at least ``MIN_CUDA_REPEATS``)."""
        return repeats if self.synchronize else max(1, repeats // 2)


def plan_for(device: str, model: str) -> DevicePlan:
    """The plan of ``model`` (one of :data:`MODELS`) on ``device`` (``'cpu'``, ``'cuda'``,
    ``'cuda:1'``); no device is touched."""
    if model not in MODELS:
        raise ValueError(f'unknown model {model!r}; one of {MODELS}')
    if is_cuda(device):
        size = VIT_SIZES[0] if model in PLAIN_VITS else DETECTION_SIZE
        return DevicePlan(device=device, synchronize=True, memory=PEAK_CUDA, sizes=(size, ),
                          train_size=size, batch=CUDA_BATCH, dtypes=DTYPES,
                          repeats=MIN_CUDA_REPEATS, min_repeats=MIN_CUDA_REPEATS,
                          warmup=CUDA_WARMUP, processes=1, clocks=('wall', ))
    return DevicePlan(device=device, synchronize=False, memory=SAVED_ACTIVATIONS,
                      sizes=VIT_SIZES if model in PLAIN_VITS else SWIN_CPU_SIZES,
                      train_size=CPU_TRAIN_SIZE, batch=CPU_BATCH, dtypes=('fp32', ),
                      repeats=CPU_REPEATS, min_repeats=1, warmup=CPU_WARMUP,
                      processes=CPU_PROCESSES, clocks=CLOCKS)


class Timer:
    """Seconds of one call on ``clock``; with ``synchronize`` the device is synchronised
    before starting and before stopping the clock, so queued GPU work is counted."""

    def __init__(self, clock: str, device: str, synchronize: bool) -> None:
        if clock not in CLOCKS:
            raise ValueError(f'unknown clock {clock!r}; one of {CLOCKS}')
        self.clock: Callable[[], float] = (time.perf_counter if clock == 'wall'
                                           else time.process_time)
        self.device = device
        self.synchronize = synchronize

    def sync(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = self.clock()
        fn()
        self.sync()
        return self.clock() - start


def make_timer(plan: DevicePlan, clock: str) -> Timer:
    if clock not in plan.clocks:
        raise ValueError(f'--clock {clock} does not measure work on {plan.device} (CPU time '
                         f'misses the GPU kernels); use one of {plan.clocks}')
    return Timer(clock, plan.device, plan.synchronize)


def autocast_for(device: str, dtype: str) -> Callable[[], ContextManager[object]]:
    """A factory of the context each measured call runs in: nothing for fp32, autocast for
    bf16 (weights stay fp32, as in mixed-precision training)."""
    if dtype not in DTYPES:
        raise ValueError(f'unknown dtype {dtype!r}; one of {DTYPES}')
    if dtype == 'fp32':
        return contextlib.nullcontext
    kind = device_type(device)
    return lambda: torch.autocast(device_type=kind, dtype=torch.bfloat16)


def saved_activation_bytes(fn: Callable[[], object], params: Sequence[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves for backward while ``fn`` runs (parameters
    excluded)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def peak_cuda_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak bytes allocated on ``device`` above the start while ``fn`` runs a training forward
    and backward."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def memory_bytes(plan: DevicePlan, forward: Callable[[], object],
                 train_step: Callable[[], object], params: Sequence[torch.Tensor]) -> int:
    """The plan's memory column for one model: saved activations of ``forward`` (CPU) or the
    peak CUDA allocation of ``train_step`` (forward + backward)."""
    if plan.memory == PEAK_CUDA:
        return peak_cuda_bytes(train_step, plan.device)
    return saved_activation_bytes(forward, params)


def check_repeats(plan: DevicePlan, repeats: Optional[int]) -> int:
    """``--repeats`` resolved against the plan; a clear error below its minimum."""
    value = plan.repeats if repeats is None else repeats
    if value < max(1, plan.min_repeats):
        least = max(1, plan.min_repeats)
        raise ValueError(f'--repeats must be at least {least}, got {value} (the median of at '
                         f'least {least} timed runs on {plan.device})')
    return value
