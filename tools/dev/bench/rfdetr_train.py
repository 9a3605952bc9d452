"""``tools/benchmark.py --rfdetr-train [N | N-Seg]``: RF-DETR N's training step and eval forward,
ours against the ``rfdetr`` package's, CPU, one process, the same batch and weights.

Weights: :func:`~dev.bench.rfdetr_onnx.build_models` (rfdetr's seeded model, written in its own
format, read into our detector through the layout table; 91 logits on both sides). The batch:
``batch`` uint8 BGR images at RF-DETR N's resolution (384 px; RF-DETR-Seg N: 312) with
:data:`BOXES` random boxes each (and their masks for the seg model).

* training step, each side's whole optimizer step: ours ``model.train_step`` with the shipped
  config's optimizer wrapper (data preprocessor, Group DETR forward, losses, backward, clipping,
  AdamW on its layer-decay groups); rfdetr's the same as its Lightning module does it without
  Lightning (normalisation, ``LWDETR`` forward, its ``SetCriterion``, backward, clipping at
  ``clip_max_norm``, AdamW on ``get_param_dict``'s groups);
* eval forward (no grad): ours ``model.test_step`` (preprocessor, forward, mmdet's
  post-processing), rfdetr's normalisation, forward and ``PostProcess``.

Median seconds (``--clock``: wall, or the process's CPU time, steadier on a shared machine) of
``repeats`` runs interleaved with the other side's (both see the same machine load) after
``warmup`` untimed ones; ratio = ours / rfdetr's (< 1: ours is faster).
"""
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from dev.bench.plan import Timer
from dev.bench.rfdetr_onnx import MEAN, PIXEL_MAX, STD, build_models

#: Ground-truth boxes per image (random, fixed seed).
BOXES = 8
#: Images per batch by default (RF-DETR's TrainConfig.batch_size is 4; 2 keeps a CPU step short).
DEFAULT_BATCH = 2
SEED = 0


def _batch(size: int, batch: int, seg: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """``(uint8 BGR images (B, 3, S, S), labels (B, BOXES), boxes (B, BOXES, 4) normalised
    cx, cy, w, h, masks (B, BOXES, S, S) bool)``; the masks fill the boxes (seg only, else
    empty)."""
    g = torch.Generator().manual_seed(SEED)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g)
    labels = torch.randint(1, 91, (batch, BOXES), generator=g)
    centres = 0.25 + 0.5 * torch.rand(batch, BOXES, 2, generator=g)
    sides = 0.05 + 0.4 * torch.rand(batch, BOXES, 2, generator=g)
    boxes = torch.cat([centres, sides], -1)
    masks = torch.zeros(batch, BOXES if seg else 0, size, size, dtype=torch.bool)
    if seg:
        xyxy = (torch.cat([centres - sides / 2, centres + sides / 2], -1) * size).long()
        for b in range(batch):
            for i, (x0, y0, x1, y1) in enumerate(xyxy[b].tolist()):
                masks[b, i, y0:y1, x0:x1] = True
    return images, labels, boxes, masks


def _ours(model: Any, config: str, images, labels, boxes, masks
          ) -> Tuple[Callable[[], object], Callable[[], object]]:
    """Our (training step, eval forward) on the batch."""
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.optim import build_optim_wrapper
    from mmengine.structures import InstanceData

    from vitdet_plugin.config import load_config

    size = images.shape[-1]
    samples = []
    for b in range(len(images)):
        cxcy, wh = boxes[b, :, :2], boxes[b, :, 2:]
        gt = InstanceData(bboxes=torch.cat([cxcy - wh / 2, cxcy + wh / 2], -1) * size,
                          labels=labels[b])
        if masks.shape[1]:
            gt.masks = BitmapMasks(masks[b].numpy(), size, size)
        sample = DetDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size),
                                             scale_factor=(1.0, 1.0)))
        sample.gt_instances = gt
        samples.append(sample)
    data = dict(inputs=list(images), data_samples=samples)
    # the batch's own size on both sides: rfdetr's step runs without its multi-scale
    # (MultiScale.OFF), so ours without the config's RFDETRBatchScale (which would resize the
    # batch to the scale it draws for step 0, 416 px for RF-DETR N)
    model.data_preprocessor.batch_augments = None
    wrapper = build_optim_wrapper(model, load_config(config).optim_wrapper)

    def train_step() -> object:
        model.train()
        return model.train_step(data, wrapper)

    def eval_forward() -> object:
        model.eval()
        with torch.no_grad():
            return model.test_step(data)

    return train_step, eval_forward


def _rfdetr(theirs: Any, images, labels, boxes, masks
            ) -> Tuple[Callable[[], object], Callable[[], object]]:
    """rfdetr's (training step, eval forward) on the batch (its Lightning module's step,
    without Lightning)."""
    from rfdetr._namespace import _namespace_from_configs
    from rfdetr.config import MultiScale, TrainConfig
    from rfdetr.models.lwdetr import build_criterion_from_config
    from rfdetr.training.param_groups import get_param_dict
    from rfdetr.utilities.tensors import NestedTensor

    net = theirs.model.model
    train_config = TrainConfig(dataset_dir=tempfile.gettempdir(), multi_scale=MultiScale.OFF)
    criterion, postprocess = build_criterion_from_config(theirs.model_config, train_config)
    namespace = _namespace_from_configs(theirs.model_config, train_config)
    optimizer = torch.optim.AdamW(get_param_dict(namespace, net), lr=train_config.lr,
                                  weight_decay=train_config.weight_decay)
    size = images.shape[-1]
    sizes = torch.tensor([[size, size]] * len(images))
    targets = []
    for b in range(len(images)):
        target = dict(labels=labels[b], boxes=boxes[b], orig_size=sizes[b], size=sizes[b])
        if masks.shape[1]:
            target['masks'] = masks[b]
        targets.append(target)
    mean = torch.tensor(MEAN)[:, None, None] / PIXEL_MAX
    std = torch.tensor(STD)[:, None, None] / PIXEL_MAX

    def normalised() -> NestedTensor:
        x = (images.flip(1).float() / PIXEL_MAX - mean) / std           # (B, 3, H, W) RGB
        return NestedTensor(x, torch.zeros(len(images), size, size, dtype=torch.bool))

    def train_step() -> object:
        net.train()
        criterion.train()
        losses = criterion(net(normalised(), targets), targets)
        loss = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), train_config.clip_max_norm)
        optimizer.step()
        return loss

    def eval_forward() -> object:
        net.eval()
        with torch.no_grad():
            return postprocess(net(normalised()), sizes)

    return train_step, eval_forward


def run_rfdetr_train(timer: Timer, model: str = 'N', repeats: int = 5, warmup: int = 1,
                     batch: int = DEFAULT_BATCH) -> Dict[str, Any]:
    """Time both sides' training step and eval forward (module docstring); print the table."""
    from dev.bench.rfdetr_onnx import CONFIGS, MODELS

    with tempfile.TemporaryDirectory(prefix='rfdetr_train_') as folder:  # the checkpoint
        theirs, ours = build_models(folder, model)
    size = int(theirs.model_config.resolution)
    images, labels, boxes, masks = _batch(size, batch, seg=model.endswith('Seg'))
    ours_train, ours_eval = _ours(ours, os.path.join(CONFIGS, MODELS[model][1]), images, labels,
                                  boxes, masks)
    theirs_train, theirs_eval = _rfdetr(theirs, images, labels, boxes, masks)
    pairs = {'training step': (ours_train, theirs_train),
             'eval forward': (ours_eval, theirs_eval)}
    for fns in pairs.values():
        for _ in range(warmup):
            for fn in fns:
                fn()
    load_before = os.getloadavg()[0]
    times: Dict[str, List[List[float]]] = {row: [[], []] for row in pairs}
    for row, fns in pairs.items():
        for _ in range(repeats):
            for side, fn in enumerate(fns):
                times[row][side].append(timer(fn))
    load_after = os.getloadavg()[0]
    clock = 'wall' if timer.clock is not time.process_time else 'cpu'
    print(f'RF-DETR {model}, {size}x{size}, batch {batch}, CPU, {torch.get_num_threads()} '
          f'threads, {clock} clock, median of {repeats} interleaved runs after {warmup} untimed; '
          f'load average {load_before:.1f} -> {load_after:.1f}', flush=True)
    print('| row | ours s | rfdetr s | ratio (ours / rfdetr) |', flush=True)
    result: Dict[str, Any] = dict(model=model, size=size, batch=batch, clock=clock,
                                  load=(load_before, load_after))
    for row, (ours_s, theirs_s) in times.items():
        o, t = statistics.median(ours_s), statistics.median(theirs_s)
        print(f'| {row} | {o:.3f} | {t:.3f} | {o / t:.2f}x |', flush=True)
        result[row] = dict(ours=ours_s, rfdetr=theirs_s, ratio=o / t)
    return result
