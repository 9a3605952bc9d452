"""The functional GPU checks, by group (``tools/dev/gpu_check.py checks GROUP``):

* ``ops``: mmcv's ops on the compile-free backend, CUDA vs CPU (:mod:`.op_checks`);
* ``backbones``: SwinBackbone / ViTBackbone CUDA vs CPU in fp32 (TF32 off), bf16 autocast;
* ``detectors``: one bf16 AMP training step and one inference step of RetinaNet and Mask R-CNN;
  an FSDP2Wrapper step on a world of 1 (bf16 mixed-precision policy, checkpointing); the
  end-to-end graph's module (``tools/export_onnx.py --part detector`` before the export) of
  both on the GPU vs on the CPU;
* ``dino``: a shrunk DINO (configs/swin_dino.py) training step in fp32 and in bf16 AMP, then
  inference: MultiScaleDeformableAttention on CUDA inside a real detector.

Each check returns what it measured or raises (a parity miss is an ``AssertionError``); the
group's results are written after every check (:func:`.results.run_checks`).
"""
import copy
import traceback
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, cast
from unittest import mock

import torch
from torch import Tensor, nn

from .results import (CHECKS_PREFIX, Result, error_line, publish, results_json, run_checks,
                      write_part)

if TYPE_CHECKING:
    from mmengine.optim import OptimWrapper

ROOT = Path(__file__).resolve().parents[3]
Check = Tuple[str, Callable[[], str]]
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
DET_ITEMS = [5, 3]
DET_CONFIGS = ('configs/swin_retinanet.py', 'configs/swin_mask_rcnn.py')
NOISE_STD = 0.02
#: DINO, shrunk as tests/models/heads/test_detr_head.py does (a stem Swin, fewer layers and
#: queries), at a small image size: the deformable attention of its encoder and decoder runs
#: on CUDA.
DINO_CONFIG = 'configs/swin_dino.py'
DINO_SIZE = (320, 416)
DINO_SWIN = dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8])
DINO_LAYERS = 2
DINO_QUERIES = 100
DINO_DN_QUERIES = 20
#: FSDP2Wrapper check: configs/vit_mask_rcnn.py with a small ViT at a small size
FSDP_CONFIG = 'configs/vit_mask_rcnn.py'
FSDP_VIT = dict(embed_dims=192, depth=4, num_heads=3, global_attn_indexes=(1, 3))
FSDP_SIZE = (256, 384)
#: End-to-end check: one uint8 image of this size (not a multiple of the pad divisor).
E2E_SIZE = (480, 650)
#: parameters a DINO training step must update: the backbone and the deformable attention
DINO_UPDATED = ('backbone.', 'sampling_offsets')


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
        f'{name}: {device} vs CPU outputs {err_out:.1e}, input grad {err_grad:.1e} '
        f'> {PARITY_TOL}')
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


def _optim_wrapper(model: nn.Module, optim_cfg: Any, amp: bool) -> 'OptimWrapper':
    from mmengine.optim import build_optim_wrapper
    optim_cfg = copy.deepcopy(optim_cfg)
    if amp:
        optim_cfg.update(type='AmpOptimWrapper', dtype='bfloat16')
        optim_cfg.pop('loss_scale', None)
    return build_optim_wrapper(model, optim_cfg)


def _build(model_cfg: Any, device: str) -> Any:
    from mmdet.registry import MODELS
    model = MODELS.build(copy.deepcopy(model_cfg))
    model.init_weights()  # DINO's level_embed, the heads' priors; no weights on the machine
    return model.to(device)


def _demo_data(model_cfg: Any, size: Tuple[int, int], with_mask: bool) -> dict:
    from mmdet.testing import demo_mm_inputs
    head = model_cfg.get('bbox_head') or model_cfg.roi_head.bbox_head
    return demo_mm_inputs(batch_size=DET_BATCH, image_shapes=[(3, *size)] * DET_BATCH,
                          num_items=DET_ITEMS, num_classes=head.num_classes,
                          with_mask=with_mask)


def _train_and_infer(name: str, model: Any, optim_wrapper: 'OptimWrapper', data: dict,
                     must_update: Sequence[str]) -> str:
    """One training step (finite losses, the ``must_update`` parameters changed), then one
    inference step with predictions on the model's device."""
    model.train()
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    losses = model.train_step(data, optim_wrapper)
    bad = {k: float(v) for k, v in losses.items() if not torch.isfinite(v).all()}
    assert not bad, f'{name}: non-finite losses {bad}'
    changed = [k for k, v in model.named_parameters() if k in before
               and not torch.equal(v.detach(), before[k])]
    for key in must_update:
        assert any(key in k for k in changed), f'{name}: no {key!r} parameter updated'
    model.eval()
    with torch.no_grad():
        results = model.test_step(data)
    device = next(model.parameters()).device
    assert len(results) == DET_BATCH and all(
        r.pred_instances.bboxes.device == device for r in results), f'{name}: no predictions'
    total = sum(float(v) for k, v in losses.items() if 'loss' in k)
    return (f'loss {total:.3f} finite, {len(changed)}/{len(before)} params updated, '
            f'{sum(len(r.pred_instances) for r in results)} boxes predicted')


def check_detector(config: str, device: str) -> str:
    """One bf16 (AMP) training step at 800x1216, batch 2, then one inference step (NMS and,
    for Mask R-CNN, RoIAlign on the device)."""
    from vitdet_plugin.config import load_config
    cfg = load_config(str(ROOT / config))
    cfg.model.backbone.init_cfg = None  # no weights on the machine: random init
    model = _build(cfg.model, device)
    with_mask = 'roi_head' in cfg.model and 'mask_head' in cfg.model.roi_head
    data = _demo_data(cfg.model, DET_SIZE, with_mask)
    return _train_and_infer(config, model, _optim_wrapper(model, cfg.optim_wrapper, True),
                            data, ['backbone.'])


def dino_model_cfg() -> Tuple[Any, Any]:
    """configs/swin_dino.py's model (shrunk) and optimizer wrapper."""
    from vitdet_plugin.config import load_config
    cfg = load_config(str(ROOT / DINO_CONFIG))
    m = copy.deepcopy(cfg.model)
    m.backbone.arch = dict(DINO_SWIN)
    m.backbone.init_cfg = None
    embed = int(cast(int, DINO_SWIN['embed_dims']))
    m.neck.in_channels = [embed * 2 ** i for i in m.backbone.out_indices]
    m.encoder.num_layers = m.decoder.num_layers = DINO_LAYERS
    m.num_queries = DINO_QUERIES
    m.dn_cfg.group_cfg.num_dn_queries = DINO_DN_QUERIES
    return m, cfg.optim_wrapper


def check_dino(device: str, amp: bool) -> str:
    """A training step of the shrunk DINO (fp32, or bf16 AMP) and an inference step; the
    deformable attention must call the backend's ``ms_deform_attn_forward`` / ``_backward``
    (the CUDA path of ``MultiScaleDeformableAttention``), not the pure-PyTorch fallback."""
    import mmcv.ops.multi_scale_deform_attn as msda
    model_cfg, optim_cfg = dino_model_cfg()
    model = _build(model_cfg, device)
    data = _demo_data(model_cfg, DINO_SIZE, with_mask=False)
    ext = msda.ext_module
    with mock.patch.object(ext, 'ms_deform_attn_forward',
                           wraps=ext.ms_deform_attn_forward) as fwd, \
            mock.patch.object(ext, 'ms_deform_attn_backward',
                              wraps=ext.ms_deform_attn_backward) as bwd:
        text = _train_and_infer(f'{DINO_CONFIG} {"bf16" if amp else "fp32"}', model,
                                _optim_wrapper(model, optim_cfg, amp), data, DINO_UPDATED)
    assert fwd.call_count and bwd.call_count, (
        f'ms_deform_attn ran {fwd.call_count} forward / {bwd.call_count} backward calls: '
        'the deformable attention did not take the op path')
    return f'{text}; ms_deform_attn {fwd.call_count} fwd / {bwd.call_count} bwd calls'


def backbone_checks(device: str) -> List[Check]:
    checks: List[Check] = []
    for name, (build, shape) in _backbones().items():
        checks.append((f'{name} {device} vs cpu fp32',
                       partial(check_parity, name, build, shape, device)))
        checks.append((f'{name} bf16 fwd+bwd', partial(check_bf16, name, build, shape, device)))
    return checks


def check_fsdp2_world_of_one(device: str) -> str:
    """FSDP2Wrapper on a world of 1 (docs/large_models.md): a shrunk ViT Mask R-CNN sharded
    per block with bf16 parameters / fp32 gradient reduction and activation checkpointing,
    one training step through the layer-decay optimizer and clip_grad over DTensors, one
    inference step, then the full state dict gathered to the CPU as a checkpoint saves it.
    It proves the wrapper, the mixed-precision casts and the DTensor optimizer path on this
    GPU's kernels; not the multi-GPU collectives (NCCL all-gather / reduce-scatter)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from vitdet_plugin.config import load_config
    from vitdet_plugin.engine.fsdp import FSDP2Wrapper
    cfg = load_config(str(ROOT / FSDP_CONFIG))
    cfg.model.backbone.update(arch=dict(FSDP_VIT), init_cfg=None)
    cfg.model.neck.in_channels = FSDP_VIT['embed_dims']
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo', rank=0,
                            world_size=1, init_method=f'tcp://127.0.0.1:{port}')
    try:
        model = _build(cfg.model, device)
        wrapped = FSDP2Wrapper(model, activation_checkpointing=True, mixed_precision=dict(
            param_dtype='bfloat16', reduce_dtype='float32'))
        dtypes: List[torch.dtype] = []
        model.backbone.register_forward_hook(lambda m, a, out: dtypes.append(out[0].dtype))
        text = _train_and_infer(f'{FSDP_CONFIG} FSDP2', wrapped,
                                _optim_wrapper(wrapped, cfg.optim_wrapper, False),
                                _demo_data(cfg.model, FSDP_SIZE, True), ['backbone.'])
        assert dtypes and set(dtypes) == {torch.bfloat16}, dtypes
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        tensors = [v for v in full.values() if isinstance(v, Tensor)]
        assert tensors and len(tensors) == len(full) and all(
            type(v) is Tensor and v.device.type == 'cpu' for v in tensors)
        assert {v.dtype for v in tensors if v.is_floating_point()} == {torch.float32}
    finally:
        dist.destroy_process_group()
    return f'{text}; backbone ran in bf16; full state dict of {len(full)} tensors on the CPU'


def check_end_to_end(config: str, device: str) -> str:
    """The end-to-end detector module (preprocessing, network, decoding, NMS through the
    graph's NMS op, RoIAlign and the mask paste for Mask R-CNN) on ``device`` vs on the CPU,
    fp32 (TF32 off), perturbed random weights: the same number of detections, scores, boxes and
    labels within the export check's tolerances (ranks whose scores tie excepted), mask IoU.
    It proves the module's tensors follow the model's device (no CPU-made index or grid)."""
    from vitdet_plugin.config import load_config
    from vitdet_plugin.deploy.end_to_end import OUTPUT_NAMES, EndToEndDetector
    from vitdet_plugin.deploy.end_to_end_check import parity
    cfg = load_config(str(ROOT / config))
    cfg.model.backbone.init_cfg = None
    model = _perturbed(_build(cfg.model, 'cpu')).eval()
    image = torch.randint(0, 256, (1, 3, *E2E_SIZE), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = [t.numpy() for t in EndToEndDetector(model)(image)]
        got = [t.cpu().numpy() for t in EndToEndDetector(model.to(device))(image.to(device))]
    n_ref = int(ref[3][0])
    masks = ref[4][0, :n_ref] if len(ref) > len(OUTPUT_NAMES) else None  # then mask_probs
    p = parity(got, (ref[0][0, :n_ref], ref[1][0, :n_ref], ref[2][0, :n_ref], masks, None),
               E2E_SIZE)
    assert p.ok, f'{config} on {device} vs the CPU: {p}'
    return (f'{p.num_onnx} detections, score error {p.score_error:.1e}, box error '
            f'{p.box_error:.1e} of the side' + (f', min mask IoU {p.mask_iou:.4f}'
                                                if masks is not None else ''))


def detector_checks(device: str) -> List[Check]:
    checks: List[Check] = [(f'{Path(c).stem} bf16 train + infer',
                            partial(check_detector, c, device)) for c in DET_CONFIGS]
    checks.append(('FSDP2 world of 1: bf16 params, checkpointing, train + infer + full state',
                   partial(check_fsdp2_world_of_one, device)))
    checks += [(f'{Path(c).stem} end-to-end module vs CPU', partial(check_end_to_end, c, device))
               for c in DET_CONFIGS]
    return checks


def dino_checks(device: str) -> List[Check]:
    stem = Path(DINO_CONFIG).stem
    return [(f'{stem} fp32 train + infer', partial(check_dino, device, False)),
            (f'{stem} bf16 train + infer', partial(check_dino, device, True))]


def group_checks(group: str, device: str) -> List[Check]:
    """The checks of ``group``, after ``import vitdet_plugin`` (the compile-free ops in place
    before anything imports ``mmcv.ops``), TF32 off and a fixed seed."""
    import vitdet_plugin  # noqa: F401  (registers our modules, the compile-free ops)

    from .op_checks import op_checks
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    groups: Dict[str, Callable[[str], List[Check]]] = {
        'ops': op_checks, 'backbones': backbone_checks, 'detectors': detector_checks,
        'dino': dino_checks}
    return groups[group](device)


def main(group: str, device: str, results: Path, out: Optional[Path]) -> int:
    """Run ``group``'s checks; its part is rewritten and published after every check."""
    part = f'{CHECKS_PREFIX}{group}'

    def record(rs: Sequence[Result]) -> None:
        write_part(results, part, results_json(rs))
        publish(results, out)
    try:
        checks = group_checks(group, device)
    except Exception as e:  # recorded, so the report says why the group has no results
        traceback.print_exc()
        record([Result(f'{group}: setup', False, error_line(e), 0.0)])
        return 1
    return 0 if all(r.ok for r in run_checks(checks, record)) else 1
