"""Benchmark our ViT-B (ViTDet) against timm's ``samvit_base_patch16`` with the same weights.

Both run in the same process, interleaved repeat by repeat, on the same inputs:

* forward (eval, no grad) at each size (default 1024x1024, the ViTDet input);
* forward + backward (train mode, no drop path) at ``--backward-size``;
* memory: on CPU the bytes of activations saved for backward (distinct storages seen by
  ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded); on CUDA the peak of
  ``torch.cuda.max_memory_allocated`` above the weights.

timm's features are taken before its neck (``forward_intermediates(..., intermediates_only)``),
so both compute exactly the same 12 blocks. Ratios are ours / timm (< 1 is better).

    python tools/benchmark_vit.py [--device cpu|cuda] [--sizes 1024 800x1216] [--repeats 3]

:func:`run` returns the rows for ``tools/benchmark.py``.
"""
import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: shared helpers

# tools/benchmark.py
from benchmark import peak_cuda_bytes, saved_activation_bytes, sync  # noqa: E402

Size = Tuple[int, int]


def parse_size(text: Union[str, int, Sequence[int]]) -> Size:
    if isinstance(text, int):
        return (text, text)
    if not isinstance(text, str):
        h, w = text
        return (int(h), int(w))
    parts = text.lower().split('x')
    return (int(parts[0]), int(parts[-1]))


def build_models(device: str) -> Tuple[nn.Module, nn.Module]:
    """Our ViT-B and timm's samvit_base_patch16 (1024 input) holding the same weights."""
    import timm

    import vitdet_plugin  # noqa: F401  (registers and checks the stack)
    from vitdet_plugin.models.backbones import ViTBackbone
    from vitdet_plugin.weights.common import load_state_dict_checked
    from vitdet_plugin.weights.vit import convert_vit, vit_target_shapes

    ref = timm.create_model('samvit_base_patch16', pretrained=False, num_classes=0,
                            drop_path_rate=0.0)
    ours = ViTBackbone(arch='base', img_size=1024, pretrain_img_size=1024,
                       pretrain_use_cls_token=False, drop_path_rate=0.0)
    with torch.no_grad():  # non-trivial norms / rel-pos so both do all the work
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sd, _ = convert_vit(ref.state_dict(), vit_target_shapes(ours), pos_grid=ours.pretrain_grid)
    load_state_dict_checked(ours, sd)
    return ours.to(device), ref.to(device)


def _features(model: nn.Module, ours: nn.Module) -> Callable[[Tensor], Tensor]:
    if model is ours:
        return lambda x: model(x)[0]
    last = len(model.blocks) - 1
    return lambda x: model.forward_intermediates(x, indices=[last], intermediates_only=True)[0]


def _time(fn: Callable[[], object], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def run(device: str = 'cpu', sizes: Sequence[Union[str, int, Size]] = (1024,),
        repeats: int = 3, backward_size: Union[str, int, Size] = 512) -> List[dict]:
    """Time and measure both models; returns rows ``dict(metric, size, ours, timm, ratio)``
    (seconds for times, bytes for memory; ratio = ours / timm)."""
    torch.manual_seed(0)
    ours, ref = build_models(device)
    models = {'ours': ours, 'timm': ref}
    feats = {k: _features(m, ours) for k, m in models.items()}
    rows: List[dict] = []

    def add(metric: str, size: Size, values: Dict[str, float]) -> None:
        rows.append(dict(metric=metric, size=f'{size[0]}x{size[1]}', ours=values['ours'],
                         timm=values['timm'], ratio=values['ours'] / values['timm']))

    for size in map(parse_size, sizes):
        x = torch.randn(1, 3, *size, device=device)
        for m in models.values():
            m.eval()
        with torch.no_grad():
            out_o, out_t = feats['ours'](x), feats['timm'](x)  # warm-up + parity check
            err = ((out_o - out_t).abs().max() / out_t.abs().max()).item()
            if err > 1e-4:
                raise RuntimeError(f'ours and timm disagree at {size}: rel err {err:.2e}')
            del out_o, out_t
            times: Dict[str, List[float]] = {k: [] for k in models}
            for _ in range(repeats):
                for k in models:
                    times[k].append(_time(lambda: feats[k](x), device))
        add('forward_s', size, {k: statistics.median(v) for k, v in times.items()})

    size = parse_size(backward_size)
    x = torch.randn(1, 3, *size, device=device)
    for m in models.values():
        m.train()
    times = {k: [] for k in models}
    for i in range(repeats + 1):
        for k, m in models.items():
            m.zero_grad(set_to_none=True)
            t = _time(lambda: feats[k](x).float().square().mean().backward(), device)
            if i:  # first round is warm-up
                times[k].append(t)
    add('fwd_bwd_s', size, {k: statistics.median(v) for k, v in times.items()})
    if device.startswith('cuda'):
        mem = {k: float(peak_cuda_bytes(lambda: feats[k](x), device)) for k in models}
        add('peak_cuda_bytes', size, mem)
    else:
        mem = {k: float(saved_activation_bytes(lambda: feats[k](x), list(m.parameters())))
               for k, m in models.items()}
        add('saved_activation_bytes', size, mem)
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    lines = [f'{"metric":<24}{"size":>11}{"ours":>14}{"timm samvit":>14}{"ours/timm":>11}']
    for r in rows:
        if r['metric'].endswith('_bytes'):
            vals = f'{r["ours"] / 2**20:>11.1f}MiB{r["timm"] / 2**20:>11.1f}MiB'
        else:
            vals = f'{r["ours"]:>13.3f}s{r["timm"]:>13.3f}s'
        lines.append(f'{r["metric"]:<24}{r["size"]:>11}{vals}{r["ratio"]:>10.3f}x')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--sizes', nargs='+', default=['1024'],
                        help='forward sizes, N or HxW')
    parser.add_argument('--backward-size', default='512')
    parser.add_argument('--repeats', type=int, default=3)
    args = parser.parse_args()
    rows = run(args.device, args.sizes, args.repeats, args.backward_size)
    print(f'ViT-B (ours) vs timm samvit_base_patch16, {args.device}, fp32, '
          f'{torch.get_num_threads()} threads')
    print(format_rows(rows))


if __name__ == '__main__':
    main()
