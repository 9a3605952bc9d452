"""``tools/benchmark.py --rfdetr-onnx [N | N-Seg]``: RF-DETR N (384 px) or RF-DETR-Seg N
(312 px), CPU, batch 1, in one process: our end-to-end graph (the head's own test path traced,
``vitdet_plugin/deploy/end_to_end.py``) in onnxruntime, our model in PyTorch eager (mmdet's
data preprocessor + ``predict``), rfdetr's own ONNX export of the same weights (``export``:
torch's TorchScript exporter, opset 17, fixed at rfdetr's resolution) in onnxruntime and
rfdetr's model in PyTorch eager; median wall seconds of ``repeats`` interleaved runs (all four
see the same machine load) after ``warmup`` untimed ones.

Weights: rfdetr's model (``RFDETRNano`` / ``RFDETRSegNano``, ``pretrain_weights=None``, seeded
init) saved in its own checkpoint format and loaded through the checkpoint layout table into
our detector built from the shipped config (``configs/rfdetr/rfdetr_nano.py``: 2 x 2 windows;
``rfdetr_seg_nano.py``: one window); the head keeps the file's 91 logits, so its raw outputs
compare with rfdetr's one to one: the weight loading's check. rfdetr's graph takes the
normalised float image and returns the raw logits and boxes (and the seg model's mask logits of
every query), ours takes the uint8 image and returns the final detections (normalisation,
top-k and, for the seg model, the masks pasted at the image size inside).
"""
import argparse
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

#: rfdetr's ImageNet normalisation (its ``means`` / ``stds``), in 0-255 pixels for mmdet.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
PIXEL_MAX = 255.0
#: RF-DETR's COCO logits (``num_classes=90`` plus one), kept by our head.
RFDETR_LOGITS = 91
#: The models compared: rfdetr's class and our shipped config of the same model.
MODELS = {'N': ('RFDETRNano', 'rfdetr_nano.py'), 'N-Seg': ('RFDETRSegNano', 'rfdetr_seg_nano.py')}
CONFIGS = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'configs', 'rfdetr')
MIB = 2**20
SEED = 0


def build_models(folder: str, model: str = 'N') -> Tuple[Any, Any]:
    """``(rfdetr's model, our detector)`` of ``model`` (a key of :data:`MODELS`) with one set
    of weights: rfdetr's written to ``folder`` in its own format and read through our layout
    table."""
    import rfdetr
    from mmdet.registry import MODELS as REGISTRY
    from mmengine.registry import init_default_scope

    import vitdet_plugin  # noqa: F401  (registers our modules)
    from vitdet_plugin.config import load_config
    from vitdet_plugin.functional.checkpoint_target import CheckpointTarget
    from vitdet_plugin.models.backbones.base import state_shapes
    from vitdet_plugin.weights import load_checkpoint

    name, config = MODELS[model]
    torch.manual_seed(SEED)
    theirs: Any = getattr(rfdetr, name)(pretrain_weights=None)
    path = os.path.join(folder, f'{name}.pth')
    torch.save({'model': theirs.model.model.state_dict(),
                'args': argparse.Namespace(**vars(theirs.model.args))}, path)
    init_default_scope('mmdet')
    cfg = load_config(os.path.join(CONFIGS, config)).model
    cfg.bbox_head.num_classes = RFDETR_LOGITS
    ours = REGISTRY.build(cfg).eval()
    converted, _ = load_checkpoint(path, CheckpointTarget('RF-DETR', 'SingleStageDetector',
                                                          state_shapes(ours)))
    ours.load_state_dict(converted, strict=True)
    return theirs, ours


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_rfdetr_onnx(model: str = 'N', repeats: int = 5, warmup: int = 1) -> Dict[str, Any]:
    """Export both graphs of ``model`` (a key of :data:`MODELS`), time the four engines (module
    docstring), print the table; the checkpoint and graphs live in a temporary folder removed
    at the end."""
    with tempfile.TemporaryDirectory(prefix='rfdetr_onnx_') as folder:
        return _run(folder, model, repeats, warmup)


def _run(folder: str, model: str, repeats: int, warmup: int) -> Dict[str, Any]:
    """:func:`run_rfdetr_onnx` with its files in ``folder``."""
    from vitdet_plugin.deploy.end_to_end import EndToEndDetector, export_end_to_end
    from vitdet_plugin.deploy.end_to_end_check import compare, mmdet_predict
    from vitdet_plugin.deploy.ort_check import ort_session
    from vitdet_plugin.deploy.runner import INPUT_NAME

    theirs, ours = build_models(folder, model)
    size = int(theirs.model_config.resolution)  # rfdetr's export and test size
    ours_path = os.path.join(folder, 'ours.onnx')
    start = time.perf_counter()
    export_end_to_end(EndToEndDetector(ours), ours_path)
    ours_export = time.perf_counter() - start
    start = time.perf_counter()
    theirs_path = str(theirs.export(output_dir=os.path.join(folder, 'rfdetr'),
                                    shape=(size, size), verbose=False))
    theirs_export = time.perf_counter() - start
    ours_ort, theirs_ort = (ort_session(p, spinning=False) for p in (ours_path, theirs_path))

    g = torch.Generator().manual_seed(SEED)
    image = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=g)   # BGR
    ours_feed = {INPUT_NAME: image[None].numpy()}
    rgb = image.flip(0).float()[None] / PIXEL_MAX                        # (1, 3, H, W) 0-1
    normalised = (rgb - torch.tensor(MEAN)[:, None, None] / PIXEL_MAX) \
        / (torch.tensor(STD)[:, None, None] / PIXEL_MAX)
    theirs_feed = {theirs_ort.get_inputs()[0].name: normalised.numpy().astype(np.float32)}
    theirs_torch = theirs.model.model.eval()
    with torch.no_grad():
        expected = theirs_torch(normalised)
        metas = [dict(img_shape=(size, size), batch_input_shape=(size, size))]  # unpadded
        got = ours.bbox_head(ours.extract_feat(normalised), metas)
    det = getattr(got, 'det', got)  # the seg head's outputs: (detections, masks)
    weights_error = max(float((det.all_cls_scores[-1] - expected['pred_logits']).abs().max()),
                        float((det.all_bbox_preds[-1] - expected['pred_boxes']).abs().max()))

    def rfdetr_eager() -> object:
        with torch.no_grad():
            return theirs_torch(normalised)

    engines: Dict[str, Callable[[], object]] = {
        'ours onnxruntime (uint8 -> final detections)': lambda: ours_ort.run(None, ours_feed),
        'ours PyTorch eager (mmdet predict)': lambda: mmdet_predict(ours, image),
        'rfdetr onnxruntime (its export: normalised -> raw outputs)':
            lambda: theirs_ort.run(None, theirs_feed),
        'rfdetr PyTorch eager (LWDETR forward)': rfdetr_eager,
    }
    (parity,) = compare(ours_ort, ours, [image])
    for _ in range(warmup):
        for fn in engines.values():
            fn()
    load_before = os.getloadavg()[0]
    times: Dict[str, List[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            times[name].append(_seconds(fn))
    load_after = os.getloadavg()[0]
    reference = statistics.median(times['rfdetr onnxruntime (its export: normalised -> raw '
                                        'outputs)'])
    print(f'RF-DETR {model}, {size}x{size}, batch 1, CPU, {torch.get_num_threads()} threads, '
          f'median of {repeats} interleaved runs after {warmup} untimed; load average '
          f'{load_before:.1f} -> {load_after:.1f}', flush=True)
    print('| engine | s | ratio to rfdetr onnxruntime |', flush=True)
    for name, values in times.items():
        print(f'| {name} | {statistics.median(values):.3f} | '
              f'{statistics.median(values) / reference:.2f}x |', flush=True)
    print(f'export: ours {ours_export:.0f} s, {os.path.getsize(ours_path) / MIB:.1f} MiB '
          f'(dynamic B / H / W); rfdetr {theirs_export:.0f} s, '
          f'{os.path.getsize(theirs_path) / MIB:.1f} MiB (fixed {size}x{size})', flush=True)
    print(f'parity, ours onnxruntime vs PyTorch: box error {parity.box_error:.1e} of the side, '
          f'score error {parity.score_error:.1e}, smallest mask IoU {parity.mask_iou:.4f} '
          f'(1 without masks), labels '
          f'{"equal" if parity.labels_equal else "DIFFER"} ({"ok" if parity.ok else "FAILED"})',
          flush=True)
    print(f'same weights: our head\'s last-layer logits / boxes vs rfdetr\'s (PyTorch, eval): '
          f'max abs difference {weights_error:.1e}', flush=True)
    return dict(model=model, size=size, times=times, load=(load_before, load_after),
                export_s=dict(ours=ours_export, rfdetr=theirs_export), parity_ok=parity.ok,
                weights_error=weights_error)
