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
    else:
        configs(argv[3:], data_root, work)


if __name__ == '__main__':
    main(sys.argv[1:])
