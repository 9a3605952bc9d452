"""The op-parity module: the compile-free mmcv ops (``vitdet_plugin.ops``) against a reference,
shared by the three comparisons, and the whole-detector comparison as a command line.

    python tools/dev/op_parity.py [--detectors retinanet mask_rcnn mask2former dino]
                                  [--device cpu] [--reference compiled|ours] [--json PATH]

Shared (imported as ``dev.op_parity`` with ``tools/`` on the path): the extension switch
(:func:`use_ext`: every ``mmcv.ops`` module calls one ``mmcv._ext``, so compiled mmcv and a fresh
compile-free one run the same mmcv code in one process; :func:`ext_dispatch`: mmcv / mmdet's
CPU-only PyTorch paths routed to the extension as on CUDA), the error measures
(:func:`rel_err`, :func:`rel_l2`), generated shapes batches and the shrunk detectors. Used by
``tools/benchmark.py --model ops`` (``dev/bench/ops.py``: timed rows, ours vs compiled) and the
GPU check (``dev/gpu_check_kit/op_checks.py``: each op on CUDA vs CPU).

The command line needs compiled mmcv (``make env MMCV=compiled``); ``--reference ours`` runs the
same comparison with our ops on both sides (only the CPU routing of :func:`ext_dispatch`
differs), for a check without it. Each detector is built once from its config (random init from
a fixed seed, then every weight perturbed so that heads and sampling offsets are not at their
special init values) and fed the same generated shapes images, then run twice:

* ``ref``: compiled ``mmcv._ext`` with mmcv / mmdet's own dispatch: on CPU compiled mmcv has no
  kernel for sigmoid focal loss or multi-scale deformable attention, so there mmdet / mmcv run
  PyTorch code (``py_sigmoid_focal_loss``, ``multi_scale_deformable_attn_pytorch``);
* ``ours``: the compile-free ``mmcv._ext``, with those two routed to the extension as on CUDA.

Detectors: RetinaNet (``configs/demo/swin_retinanet_shapes.py``), Mask R-CNN
(``configs/demo/swin_mask_rcnn_shapes.py``), Mask2Former
(``configs/swin_mask2former_instance.py`` shrunk as ``tests/models/heads/test_mask2former.py``
does) and DINO (``configs/swin_dino.py`` shrunk as ``tests/models/heads/test_detr_head.py``
does). Per detector: every loss term of a training forward (abs / relative difference), the
gradients after backward (norm, largest difference relative to the
largest gradient, the worst parameter), and the eval predictions (detections per image; in
their order: largest box and score difference, label agreement, mask pixel agreement and IoU).
The extension functions each side called are listed under the table.
"""
import argparse
import collections
import contextlib
import copy
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

Outputs = List[Tensor]
#: Printed in place of the reference where compiled mmcv is absent.
COMPILED_MISSING = 'compiled mmcv not installed (make env MMCV=compiled)'
REPO, SEED = Path(__file__).resolve().parents[2], 0
#: ``im2col_step`` of mmcv's MultiScaleDeformableAttnFunction (its modules' default).
MSDA_IM2COL = 64
MASK_RCNN_CONFIG = 'configs/demo/swin_mask_rcnn_shapes.py'
MASK2FORMER_CONFIG, M2F_IMAGE = 'configs/swin_mask2former_instance.py', 128   # 128x128 batches
M2F_TINY = dict(feat=32, heads=2, ffn=64, queries=8, decoder_layers=3, encoder_layers=1,
                points=2, mask_points=256)
M2F_SWIN = dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4,
                drop_path_rate=0.0)
DETECTORS = ('retinanet', 'mask_rcnn', 'mask2former', 'dino')
REFERENCES = ('compiled', 'ours')
RETINANET_CONFIG = 'configs/demo/swin_retinanet_shapes.py'
DINO_CONFIG = 'configs/swin_dino.py'
#: Images per batch and their side, px (the demos' 192 px; the shrunk transformers 128 px).
BATCH = 2
IMAGE = {'retinanet': 192, 'mask_rcnn': 192, 'mask2former': 128, 'dino': 128}
#: Noise added to every initialised weight: random-init heads otherwise score every anchor at
#: the focal-loss prior (0.01, under RetinaNet's 0.05 threshold: no detections).
PERTURB_STD = 0.05
#: Shrunk DINO (tests/models/heads/test_detr_head.py): backbone, one encoder / decoder layer,
#: 30 queries.
DINO_SWIN = dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8])
DINO_NECK_IN = [64, 128, 256]
DINO_QUERIES, DINO_DN_QUERIES = 30, 10
#: Gradients under this fraction of the largest one are not ranked for the worst parameter
#: (a parameter whose gradient is ~0, e.g. a bias before a norm, has only rounding noise).
GRAD_FLOOR = 1e-3
#: Pixel threshold of a mask given as probabilities / logits (bool masks are used as they are).
MASK_THRESHOLD = 0.5


# ------------------------------------------------------------------ the two extension modules
def ext_holders() -> List[types.ModuleType]:
    """Every loaded ``mmcv.ops.*`` module that calls the extension (``ext_module``)."""
    import mmcv.ops  # noqa: F401  (imports every op module)
    return [m for name, m in sorted(sys.modules.items())
            if name.startswith('mmcv.ops.') and isinstance(m, types.ModuleType)
            and 'ext_module' in vars(m)]


@contextlib.contextmanager
def use_ext(module: Any) -> Iterator[None]:
    """Within the block, every ``mmcv.ops.*`` module calls ``module`` as its extension."""
    saved = [(vars(holder), vars(holder)['ext_module']) for holder in ext_holders()]
    for namespace, _ in saved:
        namespace['ext_module'] = module
    try:
        yield
    finally:
        for namespace, old in saved:
            namespace['ext_module'] = old


def compiled_ext() -> Optional[types.ModuleType]:
    """mmcv's compiled ``mmcv._ext`` if this process loaded it (ours has ``BACKEND``)."""
    ext = sys.modules.get('mmcv._ext') if ext_holders() else None
    return None if ext is None or hasattr(ext, 'BACKEND') else ext


def ours_ext() -> types.ModuleType:
    from vitdet_plugin.ops.startup import new_ext_module  # a fresh compile-free mmcv._ext
    return new_ext_module()


@contextlib.contextmanager
def ext_dispatch() -> Iterator[None]:
    """Route to the extension what mmcv / mmdet send to PyTorch on CPU, as they do on CUDA:
    ``MultiScaleDeformableAttention`` -> ``MultiScaleDeformableAttnFunction``, mmdet's
    ``FocalLoss`` with class-index targets -> ``sigmoid_focal_loss`` (mmcv's op)."""
    import mmcv.ops.multi_scale_deform_attn as msda
    from mmdet.models.losses import focal_loss as fl
    pytorch_msda, focal_forward = msda.multi_scale_deformable_attn_pytorch, fl.FocalLoss.forward

    def msda_ext(value: Tensor, shapes: Tensor, loc: Tensor, attn: Tensor) -> Tensor:
        start = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
        return msda.MultiScaleDeformableAttnFunction.apply(value, shapes, start, loc, attn,
                                                           MSDA_IM2COL)

    def focal(self: Any, pred: Tensor, target: Tensor, weight: Optional[Tensor] = None,
              avg_factor: Optional[float] = None, reduction_override: Optional[str] = None
              ) -> Tensor:
        if not self.use_sigmoid or self.activated or pred.dim() == target.dim():
            return focal_forward(self, pred, target, weight, avg_factor, reduction_override)
        return self.loss_weight * fl.sigmoid_focal_loss(
            pred, target, weight, gamma=self.gamma, alpha=self.alpha,
            reduction=reduction_override or self.reduction, avg_factor=avg_factor)

    patches = ((msda, 'multi_scale_deformable_attn_pytorch', msda_ext, pytorch_msda),
               (fl.FocalLoss, 'forward', focal, focal_forward))
    try:
        for owner, name, new, _ in patches:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, _, old in patches:
            setattr(owner, name, old)


# ------------------------------------------------------------------------ error measures
def rel_err(a: Tensor, b: Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 on the CPU (0 for empty tensors)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not b.numel():
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def rel_l2(a: Tensor, b: Tensor) -> float:
    """``|a - b|_2 / |b|_2`` in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float32).tiny))


# ------------------------------------------------------------------ generated data, detectors
def shapes_batch(num: int, size: int, seed: int = SEED) -> dict:
    """``num`` generated shapes images (uint8 CHW) with boxes, labels and masks: the input of
    a detector's ``data_preprocessor``."""
    import numpy as np
    from mmdet.structures import DetDataSample, mask
    from mmengine.structures import InstanceData
    from vitdet_plugin.datasets.shapes import ShapesSpec, image_rng, mask_to_bbox, render_scene
    spec = ShapesSpec(image_size=size, object_size=(size // 6, size // 2))
    inputs, samples = [], []
    for i in range(num):
        scene = render_scene(image_rng(seed, 'train', i), spec)
        xywh = torch.tensor([mask_to_bbox(o.mask) for o in scene.objects], dtype=torch.float32)
        sample = DetDataSample(metainfo=dict(img_id=i, img_shape=(size, size),
                                             ori_shape=(size, size), scale_factor=(1.0, 1.0)))
        sample.gt_instances = InstanceData(
            bboxes=torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1),
            labels=torch.tensor([o.label for o in scene.objects]),
            masks=mask.BitmapMasks(np.stack([o.mask for o in scene.objects]).astype(np.uint8),
                              size, size))
        inputs.append(torch.from_numpy(scene.img).permute(2, 0, 1).contiguous())
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def model_config(path: str) -> Any:
    from vitdet_plugin.config import load_config  # the config, its _base_ files resolved
    return load_config(str(REPO / path)).model


def shrink_mask2former(cfg: Any, pad: int = M2F_IMAGE) -> Any:
    """Mask2Former shrunk in size only, as ``tests/models/heads/test_mask2former.py`` shrinks it."""
    from mmdet.registry import MODELS
    cfg, t = copy.deepcopy(cfg), M2F_TINY
    cfg.backbone.update(M2F_SWIN, init_cfg=None)
    cfg.panoptic_head.in_channels = list(MODELS.build(copy.deepcopy(cfg.backbone)).out_channels)
    for aug in cfg.data_preprocessor.get('batch_augments') or []:
        aug.size = (pad, pad)
    head = cfg.panoptic_head
    head.update(feat_channels=t['feat'], out_channels=t['feat'], num_queries=t['queries'])
    head.positional_encoding.num_feats = head.pixel_decoder.positional_encoding.num_feats = (
        t['feat'] // 2)
    encoder, decoder = head.pixel_decoder.encoder, head.transformer_decoder
    encoder.num_layers, decoder.num_layers = t['encoder_layers'], t['decoder_layers']
    encoder.layer_cfg.self_attn_cfg.update(embed_dims=t['feat'], num_heads=t['heads'],
                                           num_points=t['points'])
    for key in ('self_attn_cfg', 'cross_attn_cfg'):
        decoder.layer_cfg[key].update(embed_dims=t['feat'], num_heads=t['heads'])
    for layer in (encoder, decoder):
        layer.layer_cfg.ffn_cfg.update(embed_dims=t['feat'], feedforward_channels=t['ffn'])
    cfg.train_cfg.num_points = t['mask_points']
    return cfg


def build_detector(cfg: Any, perturb: float, seed: int = SEED) -> Any:
    """The detector of a model config: ``init_weights`` from ``seed``, plus noise."""
    from mmdet.registry import MODELS
    from mmengine.logging import MMLogger
    from mmengine.registry import init_default_scope
    import vitdet_plugin  # noqa: F401  (registers our modules)
    init_default_scope('mmdet')
    MMLogger.get_instance('vitdet_plugin_ops', log_level='WARNING')  # no init_weights report
    torch.manual_seed(seed)
    model = MODELS.build(copy.deepcopy(cfg))
    model.init_weights()
    with torch.no_grad():  # off init's special values (MSDA's whole-pixel sampling offsets)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * perturb)
    return model



# ----------------------------------------------------------------- whole detectors
class RecordingExt:
    """An extension module that counts the calls of each function and forwards them."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.calls: Dict[str, int] = collections.Counter()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.ext, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return call


def shrink_dino(cfg: Any) -> Any:
    cfg = copy.deepcopy(cfg)
    cfg.backbone.update(arch=DINO_SWIN, drop_path_rate=0.0)
    cfg.neck.in_channels = DINO_NECK_IN
    cfg.encoder.num_layers = cfg.decoder.num_layers = 1
    cfg.num_queries = DINO_QUERIES
    cfg.dn_cfg.group_cfg.num_dn_queries = DINO_DN_QUERIES
    return cfg


def detector_config(name: str) -> Any:
    if name == 'mask2former':
        return shrink_mask2former(model_config(MASK2FORMER_CONFIG), IMAGE[name])
    if name == 'dino':
        return shrink_dino(model_config(DINO_CONFIG))
    return model_config(RETINANET_CONFIG if name == 'retinanet' else MASK_RCNN_CONFIG)


def run_side(model: Any, state: Dict[str, Tensor], batch: dict, ext: Any,
             dispatch: bool) -> Dict[str, Any]:
    """A training forward + backward and an eval prediction of ``model`` under ``ext``, from
    ``state`` (the training forward updates BatchNorm statistics, which eval then reads)."""
    model.load_state_dict(state)
    recording = RecordingExt(ext)
    routing = ext_dispatch() if dispatch else contextlib.nullcontext()
    with use_ext(recording), routing:
        torch.manual_seed(SEED)
        model.train()
        model.zero_grad(set_to_none=True)
        data = model.data_preprocessor(copy.deepcopy(batch), True)
        losses = model.loss(data['inputs'], data['data_samples'])
        terms: Dict[str, Tensor] = {
            k: sum(t.sum() for t in v) if isinstance(v, list) else v.sum()
            for k, v in losses.items() if 'loss' in k}
        torch.stack(list(terms.values())).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        model.eval()
        with torch.no_grad():
            data = model.data_preprocessor(copy.deepcopy(batch), False)
            preds = [s.pred_instances for s in model.predict(data['inputs'],
                                                             data['data_samples'])]
    return dict(losses={k: v.detach().double() for k, v in terms.items()}, grads=grads,
                preds=preds, calls=dict(sorted(recording.calls.items())))


def compare_losses(ours: Dict[str, Tensor], ref: Dict[str, Tensor]) -> List[Dict[str, Any]]:
    return [dict(term=k, ours=float(ours[k]), ref=float(ref[k]),
                 abs=float((ours[k] - ref[k]).abs()),
                 rel=float((ours[k] - ref[k]).abs() / ref[k].abs().clamp_min(1e-30)))
            for k in ref]


def compare_grads(ours: Dict[str, Tensor], ref: Dict[str, Tensor]) -> Dict[str, Any]:
    """Norms, the largest difference relative to the largest gradient, the worst parameter
    (relative to its own largest gradient, among those above :data:`GRAD_FLOOR`)."""
    if set(ours) != set(ref):
        return dict(missing=sorted(set(ours) ^ set(ref)))
    top = max(float(g.abs().max()) for g in ref.values())
    diffs = {n: float((ours[n].double() - ref[n].double()).abs().max()) for n in ref}
    worst = max((n for n in ref if float(ref[n].abs().max()) > GRAD_FLOOR * top),
                key=lambda n: diffs[n] / float(ref[n].abs().max()))
    norm = float(torch.stack([g.double().norm() for g in ref.values()]).norm())
    ours_norm = float(torch.stack([g.double().norm() for g in ours.values()]).norm())
    return dict(norm=norm, ours_norm=ours_norm, norm_rel=abs(ours_norm - norm) / norm,
                max_rel=max(diffs.values()) / top, worst=worst,
                worst_rel=diffs[worst] / float(ref[worst].abs().max()))


def _masks(inst: Any) -> Optional[Tensor]:
    if 'masks' not in inst:
        return None
    masks = inst.masks
    return masks if masks.dtype == torch.bool else masks > MASK_THRESHOLD


def compare_preds(ours: Sequence[Any], ref: Sequence[Any]) -> Dict[str, Any]:
    """Per image: detections of both; the first ``min`` compared in their order (and boxes
    also to the nearest of the same label in any order)."""
    out: Dict[str, Any] = dict(dets=[], box=0.0, box_any=0.0, score=0.0, label_agree=1.0)
    agree, ious = [], []
    for o, r in zip(ours, ref):
        n = min(len(o), len(r))
        out['dets'].append((len(o), len(r)))
        if n == 0:
            continue
        out['box'] = max(out['box'], float((o.bboxes[:n] - r.bboxes[:n]).abs().max()))
        # order-free: each detection of ours to the nearest of ref with its label (near-tied
        # scores may come in either order)
        near = (o.bboxes[:n, None] - r.bboxes[None, :n]).abs().amax(-1)
        near[o.labels[:n, None] != r.labels[None, :n]] = float('inf')
        out['box_any'] = max(out['box_any'], float(near.min(1).values.max()))
        out['score'] = max(out['score'], float((o.scores[:n] - r.scores[:n]).abs().max()))
        out['label_agree'] = min(out['label_agree'],
                                 float((o.labels[:n] == r.labels[:n]).float().mean()))
        om, rm = _masks(o), _masks(r)
        if om is not None and rm is not None:
            agree.append(float((om[:n] == rm[:n]).float().mean()))
            inter, union = (om[:n] & rm[:n]).sum((1, 2)), (om[:n] | rm[:n]).sum((1, 2))
            ious.append(float(torch.where(union > 0, inter / union.clamp_min(1), 1.0).min()))
    if agree:
        out.update(mask_agree=min(agree), mask_iou_min=min(ious))
    return out


def compare_detector(name: str, ref_ext: Any, ours: Any, device: str,
                     perturb: float = PERTURB_STD) -> Dict[str, Any]:
    model = build_detector(detector_config(name), perturb).to(device)
    batch, state = shapes_batch(BATCH, IMAGE[name]), copy.deepcopy(model.state_dict())
    ref = run_side(model, state, batch, ref_ext, dispatch=False)
    mine = run_side(model, state, batch, ours, dispatch=True)
    return dict(detector=name, losses=compare_losses(mine['losses'], ref['losses']),
                grads=compare_grads(mine['grads'], ref['grads']),
                preds=compare_preds(mine['preds'], ref['preds']),
                calls=dict(ours=mine['calls'], ref=ref['calls']))


def _num(value: Optional[float], fmt: str = '.1e') -> str:
    return '-' if value is None else format(value, fmt)


def table(results: Sequence[Dict[str, Any]]) -> List[str]:
    """One aligned row per detector."""
    cells = [['detector', 'loss rel max', 'worst term', 'grad norm rel', 'grad max rel',
              'worst param (its rel)', 'dets ours/ref', 'box px', 'any order', 'score', 'labels',
              'mask px', 'mask IoU min']]
    for r in results:
        worst_loss = max(r['losses'], key=lambda t: t['rel'])
        g, p = r['grads'], r['preds']
        cells.append([
            r['detector'], _num(worst_loss['rel']), worst_loss['term'], _num(g.get('norm_rel')),
            _num(g.get('max_rel')), f"{g.get('worst', '-')} ({_num(g.get('worst_rel'))})",
            ' '.join(f'{a}/{b}' for a, b in p['dets']), _num(p['box'], '.2g'),
            _num(p['box_any'], '.2g'), _num(p['score']), _num(p['label_agree'], '.3f'),
            _num(p.get('mask_agree'), '.5f'), _num(p.get('mask_iou_min'), '.3f')])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [' | '.join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def details(r: Dict[str, Any]) -> List[str]:
    lines = [f"{r['detector']}: ext calls ours {r['calls']['ours']}",
             f"{'':>{len(r['detector'])}}  ext calls ref  {r['calls']['ref']}"]
    lines += [f"  {t['term']:<24} ours {t['ours']:.9g}  ref {t['ref']:.9g}  abs {t['abs']:.1e}"
              f"  rel {t['rel']:.1e}" for t in r['losses']]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='tools/dev/op_parity.py', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--detectors', nargs='+', choices=DETECTORS, default=list(DETECTORS))
    p.add_argument('--device', default='cpu')
    p.add_argument('--perturb', type=float, default=PERTURB_STD,
                   help=f'std of the noise added to the initialised weights (default '
                        f'{PERTURB_STD}; 0: the init as it is)')
    p.add_argument('--reference', choices=REFERENCES, default='compiled',
                   help="'ours': our ops on both sides (only the CPU routing differs)")
    p.add_argument('--json', default=None, metavar='PATH', help='also write the results')
    return p


def reference_ext(reference: str) -> Tuple[Any, str]:
    if reference == 'ours':
        return ours_ext(), 'vitdet_plugin.ops (--reference ours)'
    compiled = compiled_ext()
    if compiled is None:
        raise SystemExit(f'op_parity: {COMPILED_MISSING}: this process has no compiled '
                         'mmcv._ext to compare with; run it with the Python of an environment '
                         'built by `make env MMCV=compiled` (or pass --reference ours)')
    return compiled, 'compiled mmcv._ext'


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    args = build_parser().parse_args(argv)
    ref_ext, ref_name = reference_ext(args.reference)
    torch.manual_seed(SEED)
    print(f'ops parity: vitdet_plugin.ops (ours) vs {ref_name} (ref), device={args.device}, '
          f'perturb={args.perturb}, threads={torch.get_num_threads()}, '
          f'torch={torch.__version__}', flush=True)
    results = [compare_detector(name, ref_ext, ours_ext(), args.device, args.perturb)
               for name in args.detectors]
    print('\n'.join(table(results)))
    for r in results:
        print('\n'.join(details(r)))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(reference=ref_name, device=args.device, perturb=args.perturb,
                           results=results), f, indent=1)
    return results


if __name__ == '__main__':
    main()
