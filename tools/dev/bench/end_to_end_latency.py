"""End-to-end latency: an exported detector graph in onnxruntime vs the same checkpoint in
PyTorch eval (mmdet's data preprocessor + ``predict``), batch 1, on the CPU, as a ratio.

    python tools/dev/bench/end_to_end_latency.py CONFIG CKPT MODEL.onnx
        [--sizes 192x192 800x1216] [--repeats 5] [--cfg-options k=v ...]

One row per size: median wall seconds of each (interleaved runs, one warm-up), the ratio
onnxruntime / PyTorch, and the graph's file size. Export time: ``tools/export_onnx.py`` prints
it. Random uint8 images at the graph's input size (the graph's own resizing is outside both).
"""
import argparse
import os.path as osp
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from mmengine.config import DictAction

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.deploy.end_to_end_check import mmdet_predict
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.runner import INPUT_NAME

#: Default sizes: the demo's and a COCO-like 800 x 1216.
DEFAULT_SIZES = ('192x192', '800x1216')


def _size(text: str) -> Tuple[int, int]:
    h, _, w = text.partition('x')
    return int(h), int(w or h)


def _seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('checkpoint')
    p.add_argument('onnx')
    p.add_argument('--sizes', nargs='+', default=list(DEFAULT_SIZES))
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--cfg-options', nargs='+', action=DictAction, default=None)
    args = p.parse_args(argv)
    _, model = build_model(args.config, args.checkpoint, args.cfg_options)
    session = ort_session(args.onnx)
    mib = osp.getsize(args.onnx) / 2**20
    print(f'| size | onnxruntime s | PyTorch s | ratio | file MiB |  (CPU, '
          f'{torch.get_num_threads()} threads, batch 1, median of {args.repeats})')
    for text in args.sizes:
        h, w = _size(text)
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
        feed = {INPUT_NAME: image[None].numpy()}
        ort_times: List[float] = []
        torch_times: List[float] = []
        session.run(None, feed)  # warm-up
        mmdet_predict(model, image)
        for _ in range(args.repeats):  # interleaved: both see the same machine load
            ort_times.append(_seconds(session.run, None, feed))
            torch_times.append(_seconds(mmdet_predict, model, image))
        o, t = statistics.median(ort_times), statistics.median(torch_times)
        print(f'| {h}x{w} | {o:.3f} | {t:.3f} | {o / t:.2f}x | {mib:.1f} |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
