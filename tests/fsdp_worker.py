"""Per-rank entry point of tests/engine/test_fsdp.py:
``torchrun tests/fsdp_worker.py MODE DATA WORK``.

The model is a tiny plain-ViT RetinaNet (dist_worker's, ViT backbone + simple pyramid) on the
shapes dataset, one image per rank, no random augmentation, so a 2-rank step sees exactly the
images a single process sees in two accumulated iterations. Modes:

* ``train``: FSDP2Runner trains 2 iterations (a checkpoint after each), recording every rank's
  losses, the gathered gradients of the first step and the bytes of the local shards; then a
  second runner resumes from ``iter_1.pth`` and trains to iteration 2 (``resume/iter_2.pth``);
  a third one builds the model on rank 0 only (``init_on_rank0``) and trains 1 iteration.
  Every run has an ``EMAHook`` (:data:`EMA_HOOK`); a fourth one trains 1 iteration with
  ``AmpOptimWrapper`` (:func:`amp_cfg`).
* ``kill``: as ``train`` for 50 iterations under the fault report; rank 1 SIGKILLs itself
  at iteration :data:`KILL_AT_ITER`.
* ``configs``: a shrunk training step of each FSDP config in ``sys.argv[4:]``.
* ``policy``: configs/_base_/fsdp.py exactly as shipped (bf16 mixed precision, activation
  checkpointing) on the ViT and on the ViT with a BatchNorm conv stem: one training iteration,
  then a validation with mmdet's CocoMetric (:func:`register_dtype_metric`).
"""
import json
import os
import os.path as osp
import signal
import sys
from typing import Any, Dict, List, Optional

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
EMBED_DIMS = 32
LR = 1e-3
TRAIN_ITERS = 2
KILL_AT_ITER = 4
KILL_MAX_ITERS = 50
#: checkpoints every 2 iterations in the kill run: iter_2.pth exists when rank 1 dies
KILL_CKPT_INTERVAL = 2
#: mmdet's EMA (ExpMomentumEMA, buffers averaged too); gamma 1 instead of 2000 so that the
#: second update moves the average by ~14% of the step (momentum (1 - m) e^(-2/gamma) + m)
EMA_HOOK = dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=0.0002, gamma=1,
                update_buffers=True, priority=49)


def vit_cfg(data_root: str, work_dir: str, max_iters: int, ckpt_interval: int,
            batch_size: int, launcher: str, **overrides: Any) -> dict:
    """The tiny ViT RetinaNet config (FSDP2Runner when ``launcher='pytorch'``)."""
    from dist_worker import tiny_cfg
    cfg = tiny_cfg(data_root, work_dir, max_iters=max_iters, ckpt_interval=ckpt_interval,
                   name='fsdp', backbone=dict(
                       type='ViTBackbone', arch=dict(embed_dims=EMBED_DIMS, depth=2, num_heads=2),
                       window_size=2, img_size=64, out_indices=(-1,), drop_path_rate=0.0,
                       frozen_stages=0),
                   launcher=launcher, **overrides)
    cfg['model']['neck'] = dict(type='ViTSimpleFPN', in_channels=EMBED_DIMS, out_channels=16,
                                scale_factors=(4.0, 2.0, 1.0), in_stride=16, num_outs=3)
    pipeline = cfg['train_dataloader']['dataset']['pipeline']
    cfg['train_dataloader']['dataset']['pipeline'] = [
        t for t in pipeline if t['type'] != 'RandomFlip']
    cfg['train_dataloader']['batch_size'] = batch_size
    cfg['optim_wrapper'] = dict(
        type='OptimWrapper', constructor='LayerDecayOptimWrapperConstructor',
        paramwise_cfg=dict(layer_decay_rate=0.7),
        optimizer=dict(type='AdamW', lr=LR, weight_decay=0.05),
        clip_grad=dict(max_norm=1.0))
    cfg['default_hooks']['checkpoint']['max_keep_ckpts'] = -1
    cfg['param_scheduler'] = [dict(type='MultiStepLR', by_epoch=False, milestones=[1],
                                   gamma=0.5)]
    cfg['custom_hooks'] = list(cfg['custom_hooks']) + [dict(EMA_HOOK), dict(type='FsdpRecorder')]
    if launcher == 'pytorch':
        cfg['runner_type'] = 'FSDP2Runner'
    return cfg


#: module and name of the accelerator check in ``AmpOptimWrapper.__init__``
AMP_DEVICE_CHECK = ('mmengine.optim.optimizer.amp_optimizer_wrapper', 'is_cuda_available')


def amp_cfg(cfg: dict) -> dict:
    """``cfg`` trained with ``AmpOptimWrapper`` (bf16 autocast; distributed: the sharded scaler
    on the CPU, one process: GradScaler, off without CUDA) and no EMA. mmengine refuses
    ``AmpOptimWrapper`` without an accelerator: the caller bypasses that assertion
    (:data:`AMP_DEVICE_CHECK`; the wrapper itself is unchanged: autocast, scaler, step)."""
    cfg['optim_wrapper'].update(type='AmpOptimWrapper', dtype='bfloat16')
    if cfg['launcher'] != 'none':
        cfg['optim_wrapper'].update(use_fsdp=True, loss_scale=dict(device='cpu'))
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks'] if h['type'] != 'EMAHook']
    return cfg


def register_recorder() -> None:
    """``FsdpRecorder``: each iteration's loss; the full gradients of the first optimizer step
    (gathered from the shards on every rank)."""
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS
    from torch.distributed.tensor import DTensor

    @HOOKS.register_module(force=True)
    class FsdpRecorder(Hook):
        priority = 'LOWEST'

        def __init__(self) -> None:
            self.losses: List[float] = []
            self.grads: Optional[Dict[str, Any]] = None

        def before_train(self, runner) -> None:
            optimizer = runner.optim_wrapper.optimizer
            names = {id(p): n for n, p in runner.model.named_parameters()}
            names = {k: v.removeprefix('module.') for k, v in names.items()}

            def first_grads(opt, args, kwargs) -> None:
                if self.grads is None:
                    self.grads = {names[id(p)]: (p.grad.full_tensor() if isinstance(
                        p.grad, DTensor) else p.grad).clone()
                        for g in opt.param_groups for p in g['params'] if p.grad is not None}
            optimizer.register_step_pre_hook(first_grads)

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            self.losses.append(float(outputs['loss'].detach()))


def local_bytes(runner) -> Dict[str, int]:
    """Bytes of this rank's parameter shards, of the whole model, of its optimizer state."""
    from torch.distributed.tensor import DTensor
    params = list(runner.model.module.parameters())
    local = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in params)
    total = sum(p.numel() * p.element_size() for p in params)
    optim = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes
                for state in runner.optim_wrapper.optimizer.state.values()
                for t in state.values() if hasattr(t, 'nbytes') and t.dim() > 0)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return dict(local_params=local, total_params=total, local_optim=optim,
                trainable_params=trainable)


def _runner(cfg: dict):
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    from vitdet_plugin.engine.dist import prepare_cpu_distributed
    prepare_cpu_distributed(cfg)
    return RUNNERS.build(Config(cfg))


def _recorder(runner):
    return next(h for h in runner.hooks if type(h).__name__ == 'FsdpRecorder')


def validation_swap(runner, ema) -> Dict[str, Any]:
    """The EMA hook's validation swap around an eval forward (which leaves the root's
    parameters gathered): the gathered model weights inside (``val``) and after (``after``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from vitdet_plugin.engine.fsdp_runner import GATHER
    import torch
    ema.before_val_epoch(runner)
    detector = runner.model.module
    with torch.no_grad():  # a forward without backward (the train batch has no scale_factor)
        detector(**detector.data_preprocessor(next(iter(runner.train_dataloader))),
                 mode='tensor')
    inside = get_model_state_dict(runner.model.module, options=GATHER)
    ema.after_val_epoch(runner)
    return dict(val=inside, after=get_model_state_dict(runner.model.module, options=GATHER))


def train(data_root: str, work: str) -> None:
    import torch
    rank = int(os.environ['RANK'])
    runner = _runner(vit_cfg(data_root, osp.join(work, 'fsdp'), TRAIN_ITERS, 1, 1, 'pytorch'))
    runner.train()
    rec = _recorder(runner)
    ema = next(h for h in runner.hooks if 'EMA' in type(h).__name__)
    result = dict(losses=rec.losses, bytes=local_bytes(runner),
                  wrapper=type(runner.model).__name__,
                  param_types=sorted({type(p).__name__ for p in runner.model.parameters()}),
                  ema_hook=type(ema).__name__,
                  ema_types=sorted({type(p).__name__ for p in ema.ema_model.parameters()}))
    swapped = validation_swap(runner, ema)
    resumed = _runner(vit_cfg(data_root, osp.join(work, 'resume'), TRAIN_ITERS, 1, 1, 'pytorch',
                              resume=True, load_from=osp.join(work, 'fsdp', 'iter_1.pth'),
                              experiment_name='fsdp_resume'))
    resumed.train()
    result['resumed_losses'] = _recorder(resumed).losses
    # rank 0 alone builds the weights (the others on the meta device) and sends the shards
    cfg = vit_cfg(data_root, osp.join(work, 'rank0_init'), 1, 1, 1, 'pytorch',
                  experiment_name='fsdp_rank0_init',
                  model_wrapper_cfg=dict(type='FSDP2Wrapper', init_on_rank0=True))
    rank0_init = _runner(cfg)
    result['built_on_meta'] = rank0_init.model.built_on_meta
    rank0_init.train()
    result['rank0_init_losses'] = _recorder(rank0_init).losses
    import importlib
    module, name = AMP_DEVICE_CHECK
    setattr(importlib.import_module(module), name, lambda: True)
    amp = _runner(amp_cfg(vit_cfg(data_root, osp.join(work, 'amp'), 1, 1, 1, 'pytorch',
                                  experiment_name='fsdp_amp')))
    amp.train()
    result['amp_losses'] = _recorder(amp).losses
    if rank == 0:
        torch.save(rec.grads, osp.join(work, 'grads.pt'))
        torch.save(swapped, osp.join(work, 'ema_swap.pt'))
    with open(osp.join(work, f'rank{rank}.json'), 'w') as f:
        json.dump(result, f)


def kill(data_root: str, work: str) -> None:
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    from vitdet_plugin.engine.dist_faults import DistributedFaultError, train_with_fault_report

    @HOOKS.register_module(force=True)
    class KillRank1(Hook):
        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            if int(os.environ['RANK']) == 1 and runner.iter + 1 == KILL_AT_ITER:
                print(f'rank 1: SIGKILL at iteration {runner.iter + 1}', flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    cfg = vit_cfg(data_root, work, KILL_MAX_ITERS, KILL_CKPT_INTERVAL, 1, 'pytorch')
    cfg['custom_hooks'].append(dict(type='KillRank1'))
    runner = _runner(cfg)
    try:
        train_with_fault_report(runner, config_path='fsdp_worker.py')
    except DistributedFaultError as e:
        sys.exit(f'error: {e}')


def configs(paths: List[str], data_root: str, work: str) -> None:
    """One shrunk training iteration of each config under FSDP2Runner on the shapes data."""
    from fsdp_shrink import shrunk_fsdp_cfg
    for path in paths:
        name = osp.splitext(osp.basename(path))[0]
        runner = _runner(shrunk_fsdp_cfg(path, data_root, osp.join(work, name)))
        runner.train()
        if int(os.environ['RANK']) == 0:
            with open(osp.join(work, f'{name}.json'), 'w') as f:
                json.dump(dict(iter=runner.iter, wrapper=type(runner.model).__name__,
                               losses=_recorder(runner).losses), f)


#: the shipped sharding policy, read as it is
FSDP_POLICY = osp.join(ROOT, 'configs', '_base_', 'fsdp.py')
#: the BatchNorm model: the tiny ViT with one stride-2 conv stem (BN by default)
STEM_CHANNELS = (8,)


def register_dtype_metric() -> None:
    """``DtypeCocoMetric``: mmdet's ``CocoMetric`` recording the dtypes of the predictions it
    gets (``dtypes``) and its result (``result``, rank 0)."""
    from mmdet.evaluation import CocoMetric
    from mmdet.registry import METRICS

    @METRICS.register_module(force=True)
    class DtypeCocoMetric(CocoMetric):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.dtypes: set = set()
            self.result: Dict[str, float] = {}

        def process(self, data_batch: Any, data_samples: Any) -> None:
            for sample in data_samples:
                self.dtypes.update(str(v.dtype) for v in sample['pred_instances'].values()
                                   if v.is_floating_point())
            super().process(data_batch, data_samples)

        def compute_metrics(self, results: list) -> Dict[str, float]:
            self.result = super().compute_metrics(results)
            return self.result


def policy_cfg(data_root: str, work_dir: str, name: str) -> dict:
    """``name`` ('vit' / 'bn') trained 1 iteration and validated, under the shipped policy."""
    from dist_worker import IMAGE_SIZE
    from mmengine.config import Config
    cfg = vit_cfg(data_root, work_dir, 1, 1, 1, 'pytorch', experiment_name=name)
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks'] if h['type'] != 'EMAHook']
    if name == 'bn':  # the stem trains (frozen_stages=0 would freeze it with the patch embedding)
        cfg['model']['backbone'].update(stem_channels=STEM_CHANNELS, frozen_stages=-1)
    cfg['model']['test_cfg']['score_thr'] = 0.0  # an untrained model's boxes reach the metric
    shipped = Config.fromfile(FSDP_POLICY)
    cfg['runner_type'] = shipped.runner_type
    cfg['model_wrapper_cfg'] = shipped.model_wrapper_cfg.to_dict()
    dataset = dict(cfg['train_dataloader']['dataset'], pipeline=[
        dict(type='LoadImageFromFile'),
        dict(type='Resize', scale=(IMAGE_SIZE, IMAGE_SIZE), keep_ratio=True),
        dict(type='LoadAnnotations', with_bbox=True), dict(type='PackDetInputs')])
    cfg['val_dataloader'] = dict(batch_size=1, num_workers=0, dataset=dataset,
                                 sampler=dict(type='DefaultSampler', shuffle=False))
    cfg['val_evaluator'] = dict(type='DtypeCocoMetric', metric='bbox', ann_file=osp.join(
        data_root, dataset['ann_file']))
    cfg['val_cfg'] = dict(type='ValLoop')
    cfg['train_cfg']['val_interval'] = 1
    return cfg


def policy(data_root: str, work: str) -> None:
    """Train + validate each model under the shipped policy; per rank ``policy{R}.json``: the
    prediction dtypes the metric got, its result, the dtypes a Linear and a BatchNorm compute
    with (weights as the forward sees them, input) and the BN's running statistics."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm
    register_dtype_metric()
    result = {}
    for name in ('vit', 'bn'):
        runner = _runner(policy_cfg(data_root, osp.join(work, name), name))
        seen: Dict[str, List[str]] = {}

        def record(kind: str, seen: Dict[str, List[str]] = seen):
            def hook(module, args) -> None:
                seen.setdefault(f'{kind} {"train" if module.training else "eval"}',
                                [str(module.weight.dtype), str(args[0].dtype)])
            return hook
        detector = runner.model.module
        linear = next(m for m in detector.backbone.modules() if isinstance(m, nn.Linear))
        linear.register_forward_pre_hook(record('linear'))
        norms = [m for m in detector.modules() if isinstance(m, _BatchNorm)]
        for norm in norms:
            norm.register_forward_pre_hook(record('bn'))
        runner.train()
        metric = runner.val_evaluator.metrics[0]
        result[name] = dict(dtypes=sorted(metric.dtypes), metric=metric.result, seen=seen,
                            iter=runner.iter, losses=_recorder(runner).losses,
                            norms=len(norms), running=[
                                [str(n.running_mean.dtype), float(n.running_mean.abs().sum())]
                                for n in norms])
    with open(osp.join(work, f"policy{os.environ['RANK']}.json"), 'w') as f:
        json.dump(result, f)


def main(argv: List[str]) -> None:
    import torch

    import vitdet_plugin  # noqa: F401
    torch.set_num_threads(1)
    register_recorder()
    mode, data_root, work = argv[:3]
    if mode == 'train':
        train(data_root, work)
    elif mode == 'kill':
        kill(data_root, work)
    elif mode == 'policy':
        policy(data_root, work)
    else:
        configs(argv[3:], data_root, work)


if __name__ == '__main__':
    main(sys.argv[1:])
