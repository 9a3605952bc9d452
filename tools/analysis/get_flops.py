"""FLOPs and parameter report of a config's detector at a given input size.

    python tools/analysis/get_flops.py CONFIG [--shape H W] [--depth D] [--cfg-options k=v ...]

FLOPs are counted by tracing the detector's tensor forward (backbone, neck and heads, including
RPN proposals for two-stage models) with mmengine's ``FlopAnalyzer``, on a zero image padded like
the data preprocessor pads. Convention (fvcore/mmengine): one fused multiply-add = 1 FLOP.
Attention runs through the eager path while counting so its matmuls are counted (the fused SDPA
kernel is opaque to the tracer). Post-processing (NMS, mask pasting) is not counted.
"""
import argparse
import importlib.util
import os.path as osp
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List, Tuple

import torch
from mmengine.config import DictAction
from torch import nn

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.config import load_config
from vitdet_plugin.models.layers import eager_attention
from vitdet_plugin.visualization.pyramid import pad_size_divisor, padded_shape

if TYPE_CHECKING:
    from mmdet.models.detectors import BaseDetector


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='FLOPs / params of a detector config')
    parser.add_argument('config', help='config file path')
    parser.add_argument('--shape', type=int, nargs=2, default=[800, 1333], metavar=('H', 'W'),
                        help='input image size (default: 800 1333)')
    parser.add_argument('--depth', type=int, default=1,
                        help='module depth of the breakdown table (default: 1)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if min(args.shape) < 1:
        parser.error(f'--shape {args.shape[0]} {args.shape[1]}: H and W must be positive')
    return args


class _TensorForward(nn.Module):
    """``inputs -> raw head outputs`` of an mmdet detector, for tracing."""

    def __init__(self, detector: 'BaseDetector', data_samples: list) -> None:
        super().__init__()
        self.detector = detector
        self.data_samples = data_samples

    def forward(self, inputs: torch.Tensor):
        return self.detector._forward(inputs, self.data_samples)


def dummy_batch(shape: Tuple[int, int], divisor: int):
    """A zero image and its data sample, as the data preprocessor would produce them."""
    from mmdet.structures import DetDataSample

    h, w = shape
    ph, pw = padded_shape(shape, divisor)
    sample = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(ph, pw),
                                         batch_input_shape=(ph, pw), scale_factor=(1.0, 1.0)))
    return torch.zeros(1, 3, ph, pw), [sample]


def _fmt(n: float, unit: str) -> str:
    for div, suffix in ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'K')):
        if abs(n) >= div:
            return f'{n / div:.3f} {suffix}{unit}'
    return f'{n:.0f} {unit}'


def complexity(model: 'BaseDetector', inputs: torch.Tensor, data_samples: list,
               depth: int = 1) -> Tuple[float, int, List[Tuple[str, float, int]]]:
    """Total FLOPs, total params and ``(module, flops, params)`` rows down to ``depth``."""
    from mmengine.analysis import FlopAnalyzer, parameter_count

    wrapper = _TensorForward(model, data_samples).eval()
    with torch.no_grad(), eager_attention(model):
        analyzer = FlopAnalyzer(wrapper, (inputs,))
        analyzer.unsupported_ops_warnings(False)
        analyzer.uncalled_modules_warnings(False)
        by_module = analyzer.by_module()
        total = float(analyzer.total())
    params = parameter_count(wrapper)
    rows: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for name, _ in wrapper.detector.named_modules():
        if not name or name.count('.') >= depth:
            continue
        rows[name] = [float(by_module.get(f'detector.{name}', 0)),
                      params.get(f'detector.{name}', 0)]
    return total, int(params['']), [(k, v[0], int(v[1])) for k, v in rows.items()]


def main(argv=None) -> Tuple[float, int]:
    from mmdet.registry import MODELS

    args = parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    model = MODELS.build(cfg.model).eval()
    inputs, samples = dummy_batch(tuple(args.shape), pad_size_divisor(cfg))
    total, params, rows = complexity(model, inputs, samples, args.depth)
    width = max([len(r[0]) for r in rows] + [len('total')])
    print(f'{args.config}: {type(model).__name__}, input (1, 3, {args.shape[0]}, {args.shape[1]})'
          f' -> padded {tuple(inputs.shape)}')
    print(f'{"module".ljust(width)}  {"FLOPs":>14}  {"params":>12}')
    for name, flops, p in rows:
        print(f'{name.ljust(width)}  {_fmt(flops, "FLOPs"):>14}  {_fmt(p, ""):>12}')
    print(f'{"total".ljust(width)}  {_fmt(total, "FLOPs"):>14}  {_fmt(params, ""):>12}')
    print('(1 multiply-add = 1 FLOP; NMS and other post-processing not counted)')
    return total, params


if __name__ == '__main__':
    main()
