"""The functional GPU checks: CUDA vs CPU parity, bf16 autocast, detector training and
inference steps with mmcv's CUDA ops. Each check returns a :class:`Result`; a failing check is
recorded (with its error) and the others still run."""
import copy
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from mmengine.model import BaseModel
    from mmengine.optim import OptimWrapper

ROOT = Path(__file__).resolve().parents[2]
#: CUDA vs CPU, fp32 (TF32 off): max |cuda - cpu| / max |cpu| of the outputs and input grads.
PARITY_TOL = 1e-4
#: bf16 autocast vs fp32 on CUDA: outputs by max-abs relative error, input gradients by
#: relative L2 error (bf16 keeps 8 mantissa bits; errors add up over the blocks).
BF16_OUT_TOL = 2e-2
BF16_GRAD_TOL = 1e-1  # Swin-T on CPU bf16: 4.8e-2
#: Small inputs of the parity and bf16 checks (odd sizes: padding paths run too).
SWIN_SMALL: Tuple[int, int, int, int] = (2, 3, 200, 328)
VIT_SMALL: Tuple[int, int, int, int] = (2, 3, 256, 384)
#: Detector checks: two generated images of the detection training size.
DET_BATCH = 2
DET_SIZE = (800, 1216)
DET_CONFIGS = ('configs/swin_retinanet.py', 'configs/swin_mask_rcnn.py')
NOISE_STD = 0.02
NMS_BOXES = 2000
NMS_IOU = 0.5


@dataclass
class Result:
    name: str
    ok: bool
    detail: str
    seconds: float


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _rel_l2(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _perturbed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE_STD)
    return model


def _backbones() -> Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]]:
    from vitdet_plugin.models.backbones import SwinBackbone, ViTBackbone
    return {
        'SwinBackbone': (lambda: SwinBackbone(arch='tiny', drop_path_rate=0.0), SWIN_SMALL),
        'ViTBackbone': (lambda: ViTBackbone(arch='base', img_size=VIT_SMALL[2:],
                                            drop_path_rate=0.0), VIT_SMALL),
    }


def _forward_backward(model: nn.Module, x: Tensor,
                      dtype: torch.dtype = torch.float32) -> Tuple[List[Tensor], Tensor]:
    x = x.clone().requires_grad_(True)
    with torch.autocast(device_type=x.device.type, dtype=dtype,
                        enabled=dtype != torch.float32):
        out = model(x)
    outs = [out] if isinstance(out, Tensor) else list(out)
    cast(Tensor, sum((o.float() ** 2).mean() for o in outs)).backward()  # outs: >= 1 map
    if x.grad is None:
        raise RuntimeError('the backward pass gave the input no gradient')
    return [o.detach().float() for o in outs], x.grad.detach().float()


def check_parity(name: str, build: Callable[[], nn.Module], shape: Sequence[int],
                 device: str) -> str:
    model = _perturbed(build()).train()
    x = torch.randn(*shape)
    outs_cpu, grad_cpu = _forward_backward(model, x)
    outs_gpu, grad_gpu = _forward_backward(model.to(device), x.to(device))
    err_out = max(_rel(g.cpu(), c) for g, c in zip(outs_gpu, outs_cpu))
    err_grad = _rel(grad_gpu.cpu(), grad_cpu)
    assert err_out <= PARITY_TOL and err_grad <= PARITY_TOL, (
        f'{name}: CUDA vs CPU outputs {err_out:.1e}, input grad {err_grad:.1e} > {PARITY_TOL}')
    return f'outputs {err_out:.1e}, input grad {err_grad:.1e} (tol {PARITY_TOL:.0e})'


def check_bf16(name: str, build: Callable[[], nn.Module], shape: Sequence[int],
               device: str) -> str:
    model = _perturbed(build()).to(device).train()
    x = torch.randn(*shape, device=device)
    outs32, grad32 = _forward_backward(model, x)
    model.zero_grad(set_to_none=True)
    outs16, grad16 = _forward_backward(model, x, torch.bfloat16)
    finite = all(torch.isfinite(o).all() for o in outs16) and torch.isfinite(grad16).all()
    params = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert finite and params, f'{name}: non-finite bf16 outputs or gradients'
    err_out = max(_rel(a, b) for a, b in zip(outs16, outs32))
    err_grad = _rel_l2(grad16, grad32)
    assert err_out <= BF16_OUT_TOL and err_grad <= BF16_GRAD_TOL, (
        f'{name}: bf16 vs fp32 outputs {err_out:.1e} (tol {BF16_OUT_TOL}), input grad '
        f'{err_grad:.1e} (tol {BF16_GRAD_TOL})')
    return (f'finite; outputs {err_out:.1e} (tol {BF16_OUT_TOL:.0e}), input grad L2 '
            f'{err_grad:.1e} (tol {BF16_GRAD_TOL:.0e})')


def _detector(config: str, device: str) -> Tuple['BaseModel', 'OptimWrapper', dict]:
    from mmdet.registry import MODELS
    from mmdet.testing import demo_mm_inputs
    from mmengine.optim import build_optim_wrapper

    from vitdet_plugin.datasets import load_config
    cfg = load_config(str(ROOT / config))
    cfg.model.backbone.init_cfg = None  # no weights on the machine: random init
    model = MODELS.build(copy.deepcopy(cfg.model))
    model.init_weights()
    model.to(device)
    optim_cfg = copy.deepcopy(cfg.optim_wrapper)
    optim_cfg.update(type='AmpOptimWrapper', dtype='bfloat16')
    optim_cfg.pop('loss_scale', None)
    optim_wrapper = build_optim_wrapper(model, optim_cfg)
    head = cfg.model.get('bbox_head') or cfg.model.roi_head.bbox_head
    data = demo_mm_inputs(batch_size=DET_BATCH, image_shapes=[(3, *DET_SIZE)] * DET_BATCH,
                          num_items=[5, 3], num_classes=head.num_classes,
                          with_mask='roi_head' in cfg.model
                          and 'mask_head' in cfg.model.roi_head)
    return model, optim_wrapper, data


def check_train_and_infer(config: str, device: str) -> str:
    """One bf16 (AMP) training step at 800x1216, batch 2: finite losses, backbone parameters
    updated; then one inference step (NMS and, for Mask R-CNN, RoIAlign on CUDA)."""
    model, optim_wrapper, data = _detector(config, device)
    model.train()
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    losses = model.train_step(data, optim_wrapper)
    bad = {k: float(v) for k, v in losses.items() if not torch.isfinite(v).all()}
    assert not bad, f'{config}: non-finite losses {bad}'
    changed = [k for k, v in model.named_parameters() if k in before
               and not torch.equal(v.detach(), before[k])]
    assert any(k.startswith('backbone.') for k in changed), f'{config}: backbone not updated'
    model.eval()
    with torch.no_grad():
        results = model.test_step(data)
    assert len(results) == DET_BATCH and all(
        r.pred_instances.bboxes.is_cuda for r in results), f'{config}: no CUDA predictions'
    total = sum(float(v) for k, v in losses.items() if 'loss' in k)
    return (f'loss {total:.3f} finite, {len(changed)}/{len(before)} params updated, '
            f'{sum(len(r.pred_instances) for r in results)} boxes predicted')


def check_ops(device: str) -> str:
    """mmcv's CUDA NMS keeps exactly what torchvision's does; RoIAlign matches mmcv's CPU."""
    import torchvision
    from mmcv.ops import get_compiling_cuda_version, nms, roi_align

    xy = torch.rand(NMS_BOXES, 2, device=device) * 500
    boxes = torch.cat([xy, xy + torch.rand(NMS_BOXES, 2, device=device) * 100 + 1], 1)
    scores = torch.rand(NMS_BOXES, device=device)
    _, keep = nms(boxes, scores, NMS_IOU)
    ref = torchvision.ops.nms(boxes, scores, NMS_IOU)
    assert torch.equal(keep.sort().values, ref.sort().values), 'mmcv CUDA nms != torchvision'
    feats = torch.randn(2, 16, 50, 76)
    rois = torch.tensor([[0, 10., 10, 200, 300], [1, 0, 0, 500, 400], [1, 33, 40, 90, 95]])
    cpu = roi_align(feats, rois, (7, 7), 1 / 8, 2, 'avg', True)
    gpu = roi_align(feats.to(device), rois.to(device), (7, 7), 1 / 8, 2, 'avg', True)
    err = _rel(gpu.cpu(), cpu)
    assert err <= PARITY_TOL, f'RoIAlign CUDA vs CPU {err:.1e}'
    return (f'mmcv CUDA {get_compiling_cuda_version()}: nms keeps {len(keep)} = torchvision; '
            f'roi_align vs CPU {err:.1e}')


def run_checks(device: str = 'cuda') -> List[Result]:
    import vitdet_plugin  # noqa: F401  (registers our modules, checks mmcv ops)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    checks: List[Tuple[str, Callable[[], str]]] = [('mmcv CUDA ops', lambda: check_ops(device))]
    for name, (build, shape) in _backbones().items():
        checks.append((f'{name} CUDA vs CPU fp32',
                       partial(check_parity, name, build, shape, device)))
        checks.append((f'{name} bf16 fwd+bwd', partial(check_bf16, name, build, shape, device)))
    for config in DET_CONFIGS:
        checks.append((f'{Path(config).stem} bf16 train + infer',
                       partial(check_train_and_infer, config, device)))
    results = []
    for name, fn in checks:
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as e:  # recorded; the other checks still run
            traceback.print_exc()
            detail, ok = f'{type(e).__name__}: {e}'.splitlines()[0][:300], False
        results.append(Result(name, ok, detail, time.perf_counter() - start))
        print(f"[gpu_check] {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return results


def results_json(results: Sequence[Result]) -> List[dict]:
    return [asdict(r) for r in results]
