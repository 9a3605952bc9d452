"""``tools/benchmark.py --rfdetr-onnx``: RF-DETR N at 384 px, CPU, batch 1, in one process:
our end-to-end graph (``vitdet_plugin/deploy/lwdetr.py``) in onnxruntime, our model in PyTorch
eager (mmdet's data preprocessor + ``predict``), rfdetr's own ONNX export of the same weights
(``RFDETRNano.export``: torch's TorchScript exporter, opset 17, fixed 384 x 384) in
onnxruntime and rfdetr's model in PyTorch eager; median wall seconds of ``repeats``
interleaved runs (all four see the same machine load) after ``warmup`` untimed ones.

Weights: ``RFDETRNano(pretrain_weights=None)`` (seeded init), its state dict loaded into our
``SingleStageDetector``: the backbone through the checkpoint layout table (transformers DINOv2
names under ``backbone.0.encoder.encoder.``), projector and head through the pure key maps
(``rfdetr_projector_state_dict``, ``rfdetr_head_state_dict``) until RF-DETR's checkpoint
layout is in ``vitdet_plugin/weights/``.

Our ``DINOv2Backbone`` has no RF-DETR windowing yet: ours runs global attention in all 12
blocks where RF-DETR N runs 2 x 2 windows in 8. So rfdetr is timed twice, as published
(``num_windows=2``) and with ``num_windows=1`` (global attention everywhere, the same weights:
the windowing has none), the latter the same computation as ours: its raw outputs are compared
with our head's (the weight loading's check). rfdetr's graphs take the normalised float image
and return the raw 300 x 91 logits and boxes, ours takes the uint8 image and returns the top-300
detections (normalisation and top-k inside).
"""
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

#: RF-DETR N's input side and the rfdetr model it is compared with.
SIZE = 384
#: rfdetr's ImageNet normalisation (its ``means`` / ``stds``), in 0-255 pixels for mmdet.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
PIXEL_MAX = 255.0
#: ViT-S blocks (all with global attention: the preset's default windows are ViTDet's).
DEPTH = 12
#: Prefix of rfdetr's DINOv2 (transformers names) inside its state dict.
BACKBONE_PREFIX = 'backbone.0.encoder.encoder.'
MIB = 2**20
SEED = 0


def our_detector() -> Any:
    """RF-DETR N in mmdet terms (docs/rfdetr.md), without the backbone's windowing."""
    import vitdet_plugin  # noqa: F401  (registers our modules)
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    init_default_scope('mmdet')
    return MODELS.build(dict(
        type='SingleStageDetector',
        data_preprocessor=dict(type='DetDataPreprocessor', mean=list(MEAN), std=list(STD),
                               bgr_to_rgb=True, pad_size_divisor=32),
        backbone=dict(type='DINOv2Backbone', arch='small', num_reg_tokens=0, patch_size=16,
                      pretrain_img_size=SIZE, pretrain_patch_size=16, out_indices=(2, 5, 8, 11),
                      global_attn_indexes=tuple(range(DEPTH)), drop_path_rate=0.0),
        neck=dict(type='RFDETRProjector', in_channels=(384,) * 4, out_channels=256,
                  levels=('P4',), num_blocks=3),
        bbox_head=dict(type='LWDETRHead', num_classes=91, num_queries=300, num_groups=13,
                       num_decoder_layers=2, self_heads=8, cross_heads=16, num_points=2,
                       ffn_dims=2048),
        test_cfg=dict(max_per_img=300))).eval()


def build_models() -> Tuple[Any, Any, Any]:
    """``(rfdetr's RFDETRNano, the same with num_windows=1, our detector)``, one set of
    weights."""
    from rfdetr import RFDETRNano

    from vitdet_plugin.models.heads.lwdetr_keys import rfdetr_head_state_dict
    from vitdet_plugin.models.necks.rfdetr_keys import rfdetr_projector_state_dict
    from vitdet_plugin.weights.layouts import load_checkpoint

    torch.manual_seed(SEED)
    theirs: Any = RFDETRNano(pretrain_weights=None)
    state = theirs.model.model.state_dict()
    ours = our_detector()
    backbone = {k[len(BACKBONE_PREFIX):]: v for k, v in state.items()
                if k.startswith(BACKBONE_PREFIX)}
    converted, _ = load_checkpoint(backbone, ours.backbone.checkpoint_target())
    ours.backbone.load_state_dict(converted)
    ours.neck.load_state_dict(rfdetr_projector_state_dict(state))
    ours.bbox_head.load_state_dict(rfdetr_head_state_dict(state))
    unwindowed: Any = RFDETRNano(pretrain_weights=None, num_windows=1)
    unwindowed.model.model.load_state_dict(state)
    return theirs, unwindowed, ours


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_rfdetr_onnx(repeats: int = 5, warmup: int = 1) -> Dict[str, Any]:
    """Export both graphs, time the four engines (module docstring), print the table."""
    from vitdet_plugin.deploy.end_to_end import EndToEndDetector, export_end_to_end
    from vitdet_plugin.deploy.end_to_end_check import compare, mmdet_predict
    from vitdet_plugin.deploy.ort_check import ort_session
    from vitdet_plugin.deploy.runner import INPUT_NAME

    theirs, unwindowed, ours = build_models()
    folder = tempfile.mkdtemp(prefix='rfdetr_onnx_')
    ours_path = os.path.join(folder, 'ours.onnx')
    start = time.perf_counter()
    export_end_to_end(EndToEndDetector(ours), ours_path)
    ours_export = time.perf_counter() - start
    start = time.perf_counter()
    theirs_path = str(theirs.export(output_dir=os.path.join(folder, 'rfdetr'),
                                    shape=(SIZE, SIZE), verbose=False))
    theirs_export = time.perf_counter() - start
    unwindowed_path = str(unwindowed.export(output_dir=os.path.join(folder, 'rfdetr_nw1'),
                                            shape=(SIZE, SIZE), verbose=False))
    ours_ort, theirs_ort, unwindowed_ort = (ort_session(p, spinning=False) for p in (
        ours_path, theirs_path, unwindowed_path))

    g = torch.Generator().manual_seed(SEED)
    image = torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8, generator=g)   # BGR
    ours_feed = {INPUT_NAME: image[None].numpy()}
    rgb = image.flip(0).float()[None] / PIXEL_MAX                        # (1, 3, H, W) 0-1
    normalised = (rgb - torch.tensor(MEAN)[:, None, None] / PIXEL_MAX) \
        / (torch.tensor(STD)[:, None, None] / PIXEL_MAX)
    theirs_feed = {theirs_ort.get_inputs()[0].name: normalised.numpy().astype(np.float32)}
    theirs_torch = theirs.model.model.eval()
    with torch.no_grad():
        expected = unwindowed.model.model.eval()(normalised)
        got = ours.bbox_head(ours.extract_feat(normalised))
    weights_error = max(float((got.all_cls_scores[-1] - expected['pred_logits']).abs().max()),
                        float((got.all_bbox_preds[-1] - expected['pred_boxes']).abs().max()))

    def rfdetr_eager() -> object:
        with torch.no_grad():
            return theirs_torch(normalised)

    engines: Dict[str, Callable[[], object]] = {
        'ours onnxruntime (uint8 -> top-300 detections)': lambda: ours_ort.run(None, ours_feed),
        'ours PyTorch eager (mmdet predict)': lambda: mmdet_predict(ours, image),
        'rfdetr onnxruntime (its export: normalised -> raw outputs)':
            lambda: theirs_ort.run(None, theirs_feed),
        'rfdetr num_windows=1 onnxruntime (its export; our computation)':
            lambda: unwindowed_ort.run(None, theirs_feed),
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
    print(f'RF-DETR N, {SIZE}x{SIZE}, batch 1, CPU, {torch.get_num_threads()} threads, median '
          f'of {repeats} interleaved runs after {warmup} untimed; load average '
          f'{load_before:.1f} -> {load_after:.1f}', flush=True)
    print('| engine | s | ratio to rfdetr onnxruntime |', flush=True)
    for name, values in times.items():
        print(f'| {name} | {statistics.median(values):.3f} | '
              f'{statistics.median(values) / reference:.2f}x |', flush=True)
    print(f'export: ours {ours_export:.0f} s, {os.path.getsize(ours_path) / MIB:.1f} MiB '
          f'(dynamic B / H / W); rfdetr {theirs_export:.0f} s, '
          f'{os.path.getsize(theirs_path) / MIB:.1f} MiB (fixed {SIZE}x{SIZE})', flush=True)
    print(f'parity, ours onnxruntime vs PyTorch: box error {parity.box_error:.1e} of the side, '
          f'score error {parity.score_error:.1e}, labels '
          f'{"equal" if parity.labels_equal else "DIFFER"} ({"ok" if parity.ok else "FAILED"})',
          flush=True)
    print(f'same weights: our head\'s last-layer logits / boxes vs rfdetr num_windows=1 '
          f'(PyTorch, eval): max abs difference {weights_error:.1e}', flush=True)
    print('note: our DINOv2Backbone has no RF-DETR windowing yet (global attention in all 12 '
          'blocks; rfdetr N: 2 x 2 windows in 8 of 12)', flush=True)
    return dict(size=SIZE, times=times, load=(load_before, load_after),
                export_s=dict(ours=ours_export, rfdetr=theirs_export), parity_ok=parity.ok,
                weights_error=weights_error)
