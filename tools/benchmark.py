#!/usr/bin/env python
"""Speed and memory of our backbones vs the reference implementations, side by side.

Same config, same weights, interleaved repeats; results as ratios (ours / ref). Each table row
(size, with_cp) runs in ``--processes`` fresh processes (default 3), each holding all the
compared models, so no row inherits the allocator state left by earlier rows; their repeats are
pooled and the per-process ratios printed under the row (``--same-process`` measures
everything in one process). On a shared 2-core VM the references' forward moved by up to 30%
between processes (mmdet's Swin-T at 800x1216: 2.1-2.8 s, most of the spread in the kernel's
page-fault handling of its large temporaries), more than between repeats of one process.

    python tools/benchmark.py                       # Swin-T at 224, 800x1216, 1024 on CPU
    python tools/benchmark.py --sizes 800x1216 --repeats 5
    python tools/benchmark.py --device cuda          # with a GPU
    python tools/benchmark.py --model vit            # ViT-B vs timm samvit (tools/benchmark_vit.py)

Columns: ``fwd`` median forward seconds (no grad, eval mode); ``fwd+bwd`` median seconds of a
training forward and backward; ``act MB``: on CPU, the distinct storages autograd saves for
backward in a training forward (parameters excluded); on CUDA, the peak allocated memory of a
training forward+backward above the model's own footprint.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_size(s: str) -> Tuple[int, int]:
    h, _, w = s.partition('x')
    return int(h), int(w or h)


def sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)


def saved_activation_bytes(fn: Callable[[], object], params: Sequence[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves for backward while ``fn`` runs."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def peak_cuda_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak bytes allocated on ``device`` above the start while ``fn`` runs forward (one
    tensor or a sequence of them) and backward."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    sum(o.float().mean() for o in (out if isinstance(out, (tuple, list)) else [out])).backward()
    del out
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


CLOCK = time.perf_counter


def time_calls(models: Dict[str, nn.Module], make_call: Callable[[nn.Module], Callable[[], object]],
               repeats: int, device: str, warmup: int = 1) -> Dict[str, List[float]]:
    """Seconds of every repeat per model, interleaving the models on every repeat."""
    calls = {name: make_call(m) for name, m in models.items()}
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: Dict[str, List[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, call in calls.items():
            sync(device)
            t0 = CLOCK()
            call()
            sync(device)
            times[name].append(CLOCK() - t0)
    return times


def forward_call(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return model(x)
    return call


def train_call(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def call():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out = out if isinstance(out, (tuple, list)) else (out, )
        sum(o.float().mean() for o in out).backward()
    return call


def feature_list(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return list(out)


class TimmSwinFeatures(nn.Module):
    """timm's swin returning per-stage NCHW features (like a detection backbone)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        x = self.model.patch_embed(x)
        outs = []
        for layer in self.model.layers:
            x = layer(x)
            outs.append(x.permute(0, 3, 1, 2))
        return outs


def build_swin_models(arch: str, img_size: Tuple[int, int], with_cp: bool) -> Dict[str, nn.Module]:
    from mmdet.models.backbones import SwinTransformer
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.models.backbones.swin import SWIN_ARCHS, SwinBackbone
    from vitdet_plugin.weights.swin import swin_to_mmdet
    spec = SWIN_ARCHS[arch]
    ours = SwinBackbone(arch=arch, drop_path_rate=0.0, with_cp=with_cp)
    ours.init_weights()
    mm = SwinTransformer(embed_dims=spec['embed_dims'], depths=spec['depths'],
                         num_heads=spec['num_heads'], drop_path_rate=0.0, with_cp=with_cp)
    mm.load_state_dict(swin_to_mmdet(ours.state_dict()))
    models: Dict[str, nn.Module] = {'ours': ours, 'mmdet': mm}
    if not with_cp:
        # always_partition: keep the 7x7 windows (and their shift) in stages smaller than a
        # window, as mmdet and ours do; timm would shrink them (and the bias tables with them)
        tm = TimmSwin(img_size=img_size, embed_dim=spec['embed_dims'], depths=spec['depths'],
                      num_heads=spec['num_heads'], drop_path_rate=0.0, num_classes=0,
                      strict_img_size=False, always_partition=True)
        sd = {k: v for k, v in ours.state_dict().items() if not k[:4] == 'norm'}
        sd = {(f'layers.{int(k.split(".")[1]) + 1}.' + k.split('.', 2)[2]
               if '.downsample.' in k else k): v for k, v in sd.items()}
        missing, unexpected = tm.load_state_dict(sd, strict=False)
        assert not unexpected and all('norm' in k or 'index' in k or 'mask' in k
                                      for k in missing), (missing, unexpected)
        models['timm'] = TimmSwinFeatures(tm)
    return models


def bench_swin_row(args, size: Tuple[int, int], with_cp: bool) -> dict:
    """One table row: the three models built, interleaved and measured in this process."""
    models = {k: m.to(args.device) for k, m in build_swin_models(args.arch, size, with_cp).items()}
    x = torch.randn(1, 3, *size, device=args.device)
    row = {'size': f'{size[0]}x{size[1]}', 'with_cp': with_cp}
    if not with_cp:
        for m in models.values():
            m.eval()
        row['fwd'] = time_calls(models, lambda m: forward_call(m, x), args.repeats, args.device)
    xt = torch.randn(1, 3, *args.train_size, device=args.device)
    for m in models.values():
        m.train()
    if not args.skip_backward:
        row['fwd+bwd'] = time_calls(models, lambda m: train_call(m, xt),
                                    max(1, args.repeats // 2), args.device)
    mem = {}
    for name, m in models.items():
        if args.device.startswith('cuda'):
            mem[name] = peak_cuda_bytes(lambda: m(xt), args.device) / 2**20
        else:
            mem[name] = saved_activation_bytes(lambda: m(xt), list(m.parameters())) / 2**20
    row['act MB'] = mem
    return row


def run_row_in_child(argv: Sequence[str], size: Tuple[int, int], with_cp: bool) -> dict:
    """:func:`bench_swin_row` in a fresh interpreter, so that no row inherits the allocator
    state (glibc's mmap/trim thresholds, a fragmented heap) that earlier rows left behind."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, '--row',
           f'{size[0]}x{size[1]}{":cp" if with_cp else ""}']
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f'benchmark row {cmd[-1]} failed (exit {proc.returncode}); its error '
                         'is printed above')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pool_rows(rows: Sequence[dict]) -> dict:
    """One row from the same row measured in several processes: the timing samples of all of
    them pooled (so medians are over every repeat), the per-process rows kept under
    ``'processes'``; memory is deterministic and taken from the first."""
    pooled = dict(rows[0])
    for metric in TIMED:
        if metric in pooled:
            pooled[metric] = {name: [t for row in rows for t in row[metric][name]]
                              for name in rows[0][metric]}
    pooled['processes'] = list(rows)
    return pooled


def bench_swin(args, argv: Sequence[str]) -> List[dict]:
    rows = []
    for size in args.sizes:
        for with_cp in ([False, True] if args.with_cp else [False]):
            if args.same_process:
                row = bench_swin_row(args, size, with_cp)
            else:
                row = pool_rows([run_row_in_child(argv, size, with_cp)
                                 for _ in range(args.processes)])
            rows.append(row)
            print_row(row, 'mmdet')
            mem = row['act MB']
            if with_cp and rows[-2:-1] and not rows[-2].get('with_cp'):
                plain = rows[-2]['act MB']['mmdet']
                print(f"{'':>13} | act MB: ours with_cp {mem['ours']:.3g} / mmdet without "
                      f"{plain:.3g} = {mem['ours'] / plain:.2f}x", flush=True)
    return rows


#: Timed columns (lists of seconds per model); ``'act MB'`` holds one number per model.
TIMED = ('fwd', 'fwd+bwd')


def summarise(vals: dict) -> Dict[str, float]:
    """Median of each model's samples (a timed column) or the value itself (memory)."""
    return {k: statistics.median(v) if isinstance(v, list) else v for k, v in vals.items()}


def print_row(row: dict, ref_first: str) -> None:
    head = f"{row['size']:>10}{' cp' if row.get('with_cp') else '   '}"
    parts = []
    for metric in TIMED + ('act MB', ):
        if not row.get(metric):
            continue
        vals = summarise(row[metric])
        ours = vals['ours']
        refs = ', '.join(f'{k} {v:.3g}' for k, v in vals.items() if k != 'ours')
        ratios = ', '.join(f'/{k} {ours / v:.2f}x' for k, v in vals.items() if k != 'ours' and v)
        parts.append(f'{metric}: ours {ours:.3g} ({refs}) ratio {ratios}')
    print(head + ' | ' + ' | '.join(parts), flush=True)
    procs = row.get('processes', [])
    if len(procs) > 1:
        for metric in TIMED:
            if not row.get(metric):
                continue
            each = [summarise(p[metric]) for p in procs]
            text = '; '.join(
                f'/{k} ' + ' '.join(f"{v['ours'] / v[k]:.2f}" for v in each)
                for k in each[0] if k != 'ours')
            print(f"{'':>13} | {metric} per process (median of its repeats): {text}",
                  flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--model', choices=['swin', 'vit'], default='swin')
    p.add_argument('--arch', default='tiny')
    p.add_argument('--sizes', nargs='+', type=parse_size, default=None,
                   help='input sizes HxW (default: 224x224 800x1216 1024x1024; ViT: 1024x1024)')
    p.add_argument('--train-size', type=parse_size, default=(512, 512),
                   help='input size of the training forward/backward and memory columns')
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--device', default='cpu')
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--with-cp', action='store_true', help='also measure with_cp=True')
    p.add_argument('--skip-backward', action='store_true')
    p.add_argument('--clock', choices=['wall', 'cpu'], default='wall',
                   help="'cpu': process CPU time (all threads), robust on a shared machine")
    p.add_argument('--same-process', action='store_true',
                   help='measure every row in this process (default: each (size, with_cp) row '
                        'in fresh processes; the models stay interleaved within a row)')
    p.add_argument('--processes', type=int, default=3,
                   help='fresh processes per row; their repeats are pooled (default 3: on a '
                        'shared machine the reference models\' speed moves from one process '
                        'to the next by more than the repeats within one process show)')
    p.add_argument('--row', default=None, help=argparse.SUPPRESS)  # internal: one child row
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f'--processes must be at least 1, got {args.processes}')
    if args.repeats < 1:
        p.error(f'--repeats must be at least 1, got {args.repeats}')
    if args.sizes is None:
        args.sizes = [(1024, 1024)] if args.model == 'vit' else [(224, 224), (800, 1216),
                                                                  (1024, 1024)]
    global CLOCK
    CLOCK = time.perf_counter if args.clock == 'wall' else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    # mmdet's SwinTransformer(with_cp=True) calls checkpoint() without use_reentrant
    warnings.filterwarnings('ignore', message='torch.utils.checkpoint: the use_reentrant')
    torch.manual_seed(0)
    if args.row is not None:  # child process: one row, as JSON on the last stdout line
        size, _, cp = args.row.partition(':')
        print(json.dumps(bench_swin_row(args, parse_size(size), cp == 'cp')), flush=True)
        return
    print(f'device={args.device} threads={torch.get_num_threads()} clock={args.clock} '
          f'torch={torch.__version__} load={os.getloadavg()[0]:.1f}')
    if args.model == 'vit':
        import benchmark_vit  # tools/benchmark_vit.py
        rows = benchmark_vit.run(device=args.device, sizes=args.sizes, repeats=args.repeats)
        print(benchmark_vit.format_rows(rows))
        return
    bench_swin(args, argv)


if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
