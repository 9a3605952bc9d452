"""``tools/benchmark.py --end-to-end CONFIG CKPT MODEL.onnx``: an exported end-to-end detector
graph (``tools/export_onnx.py --part detector``) in onnxruntime vs the same checkpoint in
PyTorch eval (mmdet's data preprocessor + ``predict``), batch 1, on the CPU, as a ratio.

One row per size (``--sizes``, default the demo's 192x192 and a COCO-like 800x1216): the
median wall seconds of each engine (``--repeats`` interleaved runs, so both see the same
machine load, after ``--warmup`` untimed calls), the ratio onnxruntime / PyTorch, the graph's
file size and the parity of the untimed first call (onnxruntime vs mmdet's ``predict`` on the
same image, the export check's tolerances). Random uint8 images at the graph's input size (the
resizing of the test pipeline is outside both). onnxruntime gets torch's thread count
(``--threads``) and does not spin between runs (``ort_session(spinning=False)``). Export time:
``tools/export_onnx.py`` prints it.

Refused before anything is timed (``ValueError``, one line): a missing file, a graph without
the end-to-end metadata (a backbone / neck / head export), or a graph exported from another
config (its stored pipeline metadata differs from this config's).
"""
import json
import os.path as osp
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

#: Default sizes (H, W): the demo's and a COCO-like 800 x 1216.
DEFAULT_SIZES = ((192, 192), (800, 1216))
#: What re-exports a graph, for the error messages.
EXPORT_HINT = 'export one with tools/export_onnx.py CONFIG CKPT --out MODEL.onnx --part detector'
MIB = 2**20
#: Seed of the random images.
SEED = 0


def _seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def check_files(config: str, checkpoint: str, onnx_path: str) -> None:
    """A clear ``ValueError`` for a missing file or a graph that is not end to end."""
    for what, path in (('config', config), ('checkpoint', checkpoint), ('graph', onnx_path)):
        if not osp.isfile(path):
            raise ValueError(f'--end-to-end: the {what} {path!r} does not exist')
    import onnx

    from vitdet_plugin.deploy.runner import META_KEY

    graph = onnx.load(onnx_path, load_external_data=False)
    if META_KEY not in {p.key for p in graph.metadata_props}:
        raise ValueError(f'--end-to-end: {onnx_path} is not an end-to-end detector graph (no '
                         f'{META_KEY!r} metadata; inputs '
                         f'{[i.name for i in graph.graph.input]}); {EXPORT_HINT}')


def load(config: str, checkpoint: str, onnx_path: str,
         cfg_options: Optional[dict] = None) -> Tuple[Any, Any]:
    """``(model, session)``: the checkpoint in PyTorch eval, the graph in onnxruntime; refused
    when the graph's stored pipeline metadata is not this config's."""
    check_files(config, checkpoint, onnx_path)
    import vitdet_plugin  # noqa: F401  (registers our modules)
    from vitdet_plugin.deploy.end_to_end import EndToEndDetector, pipeline_meta
    from vitdet_plugin.deploy.onnx_export import build_model
    from vitdet_plugin.deploy.ort_check import ort_session
    from vitdet_plugin.deploy.runner import META_KEY

    cfg, model = build_model(config, checkpoint, cfg_options)
    # as the export does: a DETR head's input strides fixed (both engines run the same model)
    expected = pipeline_meta(cfg, EndToEndDetector(model))
    session = ort_session(onnx_path, spinning=False)
    stored = json.loads(session.get_modelmeta().custom_metadata_map[META_KEY])
    differ = sorted(k for k in set(expected) | set(stored) if expected.get(k) != stored.get(k))
    if differ:
        raise ValueError(f'--end-to-end: {onnx_path} was not exported from {config}: its '
                         f'metadata differs in {differ}; {EXPORT_HINT}')
    return model, session


def measure(model: Any, session: Any, size: Tuple[int, int], repeats: int, warmup: int,
            mib: float) -> Dict[str, Any]:
    """One row: both engines on one random ``size`` image, interleaved ``repeats`` times after
    an untimed parity call and ``warmup`` more untimed calls."""
    from vitdet_plugin.deploy.end_to_end_check import compare, mmdet_predict
    from vitdet_plugin.deploy.runner import INPUT_NAME

    h, w = size
    g = torch.Generator().manual_seed(SEED)
    image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
    feed = {INPUT_NAME: image[None].numpy()}
    (parity, ) = compare(session, model, [image])  # the first untimed call of each engine
    for _ in range(warmup):
        session.run(None, feed)
        mmdet_predict(model, image)
    ort_times: List[float] = []
    torch_times: List[float] = []
    for _ in range(repeats):
        ort_times.append(_seconds(session.run, None, feed))
        torch_times.append(_seconds(mmdet_predict, model, image))
    ort_s, torch_s = statistics.median(ort_times), statistics.median(torch_times)
    return dict(size=f'{h}x{w}', onnxruntime=ort_times, torch=torch_times,
                ratio=ort_s / torch_s, file_mib=mib, parity_ok=parity.ok,
                box_error=parity.box_error, score_error=parity.score_error,
                detections=parity.num_onnx, torch_detections=parity.num_torch)


def format_row(row: Dict[str, Any]) -> str:
    return (f'| {row["size"]} | {statistics.median(row["onnxruntime"]):.3f} | '
            f'{statistics.median(row["torch"]):.3f} | {row["ratio"]:.2f}x | '
            f'{row["file_mib"]:.1f} | {"ok" if row["parity_ok"] else "FAILED"} |')


def parity_warning(rows: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The line printed under a table with a failed parity call (its times compare two
    different detectors), or None."""
    failed = [f'{r["size"]} ({r["detections"]} vs {r["torch_detections"]} detections)'
              for r in rows if not r['parity_ok']]
    if not failed:
        return None
    return (f'warning: onnxruntime differs from the checkpoint\'s predict at {", ".join(failed)}'
            ': the graph was probably exported from other weights (or another --cfg-options); '
            f'its times are not this checkpoint\'s; {EXPORT_HINT}')


def run_end_to_end(config: str, checkpoint: str, onnx_path: str,
                   sizes: Sequence[Tuple[int, int]] = DEFAULT_SIZES, repeats: int = 5,
                   warmup: int = 1, cfg_options: Optional[dict] = None) -> List[Dict[str, Any]]:
    """The table (printed, one row per size); the rows returned for ``--json``."""
    model, session = load(config, checkpoint, onnx_path, cfg_options)
    mib = osp.getsize(onnx_path) / MIB
    print(f'{onnx_path} vs {checkpoint} ({config}) | CPU, {torch.get_num_threads()} threads, '
          f'batch 1, median of {repeats} interleaved runs after {1 + warmup} untimed', flush=True)
    print('| size | onnxruntime s | PyTorch s | ratio onnxruntime/PyTorch | file MiB | '
          'parity |', flush=True)
    rows = []
    for size in sizes:
        rows.append(measure(model, session, size, repeats, warmup, mib))
        print(format_row(rows[-1]), flush=True)
    warning = parity_warning(rows)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return rows
