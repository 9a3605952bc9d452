"""A tiny RetinaNet + SwinBackbone training config on a generated shapes dataset.

Used in-process by tests/engine/test_resume.py and tests/test_errors.py, and as the per-rank entry
point of tests/engine/test_distributed.py (``torchrun tests/dist_worker.py DATA_ROOT WORK_DIR``):
each rank trains under DDP with a wall-clock budget (TimeBudgetHook; rank 1's clock runs
slower) and crash-safe checkpoints, and writes ``rank{R}.pt`` with its final weights.
"""
import os
import os.path as osp
import sys
from typing import List, Optional

IMAGE_SIZE = 64
NUM_IMAGES = 4


def make_data(root: str, num_images: int = NUM_IMAGES) -> str:
    """Write a tiny COCO-format shapes dataset under ``root`` (once) and return ``root``."""
    from vitdet_plugin.datasets import ShapesSpec, generate_split
    if not osp.isfile(osp.join(root, 'annotations', 'instances_train.json')):
        spec = ShapesSpec(image_size=IMAGE_SIZE, objects=(1, 2), object_size=(16, 40),
                          lines=(0, 1))
        generate_split(root, 'train', num_images, seed=0, spec=spec, progress=False)
    return root


def tiny_cfg(data_root: str, work_dir: str, max_iters: int = 6, ckpt_interval: int = 3,
             name: str = 'tiny', backbone: Optional[dict] = None,
             custom_hooks: Optional[List] = None, **overrides) -> dict:
    """A complete Runner config dict (train only, deterministic, no workers)."""
    from vitdet_plugin.datasets import CLASSES
    bb = dict(type='SwinBackbone', arch=dict(embed_dims=16, depths=(1, 1), num_heads=(1, 1)),
              window_size=4, out_indices=(0, 1), drop_path_rate=0.1)
    bb.update(backbone or {})
    model = dict(
        type='RetinaNet',
        data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                               std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32),
        backbone=bb,
        neck=dict(type='FPN', in_channels=[16, 32], out_channels=16, start_level=0,
                  add_extra_convs='on_input', num_outs=3),
        bbox_head=dict(
            type='RetinaHead', num_classes=len(CLASSES), in_channels=16, stacked_convs=1,
            feat_channels=16,
            anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4,
                                  scales_per_octave=1, ratios=[1.0], strides=[4, 8, 16]),
            bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[.0, .0, .0, .0],
                            target_stds=[1.0, 1.0, 1.0, 1.0]),
            loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25,
                          loss_weight=1.0),
            loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
        train_cfg=dict(assigner=dict(type='MaxIoUAssigner', pos_iou_thr=0.5, neg_iou_thr=0.4,
                                     min_pos_iou=0, ignore_iof_thr=-1),
                       sampler=dict(type='PseudoSampler'), allowed_border=-1, pos_weight=-1,
                       debug=False),
        test_cfg=dict(nms_pre=100, min_bbox_size=0, score_thr=0.05,
                      nms=dict(type='nms', iou_threshold=0.5), max_per_img=10))
    pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True),
        dict(type='RandomFlip', prob=0.5),  # draws from numpy's global RNG
        dict(type='PackDetInputs'),
    ]
    cfg = dict(
        model=model,
        work_dir=work_dir,
        experiment_name=name,
        default_scope='mmdet',
        train_dataloader=dict(
            batch_size=2, num_workers=0,
            sampler=dict(type='InfiniteSampler', shuffle=True),
            dataset=dict(type='CocoDataset', data_root=data_root,
                         ann_file='annotations/instances_train.json',
                         data_prefix=dict(img='train/'), metainfo=dict(classes=CLASSES),
                         filter_cfg=dict(filter_empty_gt=True), pipeline=pipeline)),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=10**6),
        optim_wrapper=dict(type='OptimWrapper',
                           optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05)),
        param_scheduler=[dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0,
                              end=4),
                         dict(type='MultiStepLR', by_epoch=False, milestones=[5], gamma=0.5)],
        default_hooks=dict(
            timer=dict(type='IterTimerHook'),
            logger=dict(type='LoggerHook', interval=1),
            param_scheduler=dict(type='ParamSchedulerHook'),
            checkpoint=dict(type='AtomicCheckpointHook', by_epoch=False,
                            interval=ckpt_interval, max_keep_ckpts=1),
            sampler_seed=dict(type='DistSamplerSeedHook')),
        custom_hooks=[dict(type='RNGStateHook'), dict(type='NonFiniteCheckHook')]
        + list(custom_hooks or []),
        log_processor=dict(type='LogProcessor', window_size=1, by_epoch=False),
        randomness=dict(seed=0, deterministic=True),
        env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo')),
        log_level='WARNING',
    )
    cfg.update(overrides)
    return cfg


#: simulated seconds per iteration of each rank's clock: rank 1 is 2.5x slower (and also
#: sleeps for real), so ranks timing themselves would plan different ends
SECONDS_PER_ITER = (1.0, 2.5)
RANK1_SLEEP_S = 0.05
#: TimeBudgetHook settings of the DDP run: rank 0 measures 1 s/it after 4 iterations and plans
#: BUDGET_S / 1 s = 12 iterations (under the cap of 100); rank 1 alone would plan 4
BUDGET_S = 12.0
DDP_CAP = 100
DDP_CKPT_INTERVAL = 5


def _register_test_hooks() -> None:
    """Register the hooks of the DDP run (a Config holds hook dicts, not hook objects)."""
    import time

    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    from vitdet_plugin.engine import time_budget

    @HOOKS.register_module(force=True)
    class DdpRankClock(Hook):
        """Advances this rank's simulated clock (read by TimeBudgetHook) per iteration."""
        priority = 'VERY_HIGH'

        def __init__(self) -> None:
            self.rank = int(os.environ['RANK'])
            self.clock = 0.0

        def before_train(self, runner) -> None:
            time_budget.now = lambda: self.clock

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            self.clock += SECONDS_PER_ITER[self.rank]
            if self.rank == 1:
                time.sleep(RANK1_SLEEP_S)

    @HOOKS.register_module(force=True)
    class DdpLrRecorder(Hook):
        """The learning rate each iteration trains with."""
        priority = 'LOWEST'

        def __init__(self) -> None:
            self.lrs: List[float] = []

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            self.lrs.append(runner.optim_wrapper.get_lr()['lr'][0])


def main(data_root: str, work_dir: str) -> None:
    """One DDP rank (launched by torchrun): train under TimeBudgetHook (rank 1 slower) with
    AtomicCheckpointHook, then dump this rank's weights, learning rates and iteration count."""
    import torch
    from mmengine.config import Config
    from mmengine.runner import Runner

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.engine.dist import prepare_cpu_distributed
    torch.set_num_threads(1)
    rank = int(os.environ['RANK'])
    _register_test_hooks()
    cfg = tiny_cfg(data_root, work_dir, max_iters=DDP_CAP, ckpt_interval=DDP_CKPT_INTERVAL,
                   name='ddp',
                   backbone=dict(arch=dict(embed_dims=16, depths=(1, 2), num_heads=(1, 1)),
                                 frozen_stages=1, with_cp=True, drop_path_rate=0.0),
                   custom_hooks=[dict(type='TimeBudgetHook', minutes=BUDGET_S / 60,
                                      measure_after=2, replan_interval=2, speed_window=1),
                                 dict(type='DdpRankClock'), dict(type='DdpLrRecorder')],
                   launcher='pytorch',
                   model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                          find_unused_parameters=False))
    cfg['param_scheduler'] = [
        dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=2),
        dict(type='CosineAnnealingLR', by_epoch=False, begin=2, end=DDP_CAP, eta_min=0.0)]
    import torch.utils.checkpoint as cp
    real_checkpoint, cp_calls = cp.checkpoint, []

    def counting_checkpoint(*args, **kwargs):  # proves with_cp is active under DDP
        cp_calls.append(kwargs.get('use_reentrant'))
        return real_checkpoint(*args, **kwargs)
    cp.checkpoint = counting_checkpoint
    assert prepare_cpu_distributed(cfg) == (not torch.cuda.is_available())
    cfg = Config(cfg)
    runner = Runner.from_cfg(cfg)
    runner.train()
    model = runner.model.module
    lrs = next(h.lrs for h in runner.hooks if type(h).__name__ == 'DdpLrRecorder')
    torch.save(dict(state=model.state_dict(), world_size=int(os.environ['WORLD_SIZE']),
                    iter=runner.iter, max_iters=runner.train_loop.max_iters, lrs=lrs,
                    checkpoint_calls=cp_calls, wrapper=type(runner.model).__name__,
                    frozen_requires_grad=[p.requires_grad for p in
                                          model.backbone.layers[0].parameters()]),
               osp.join(work_dir, f'rank{rank}.pt'))


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
