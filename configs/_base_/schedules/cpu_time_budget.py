# Iteration-based schedule bounded by wall-clock time, for CPU demos: AdamW, linear warm-up, then
# cosine decay to the end of training. `max_iters` is a cap; TimeBudgetHook measures the speed
# and moves the end of training (and of the cosine) so that training takes `budget_minutes` on
# any machine. Validation runs once, after the last iteration. Includes _base_/iter_runtime.py
# (iteration logging and checkpoints) and adds TimeBudgetHook to the runtime's hooks.
_base_ = '../iter_runtime.py'
budget_minutes = 9.5
max_iters = 100000
warmup_iters = 50
base_lr = 1e-3

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=warmup_iters),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=warmup_iters, end=max_iters,
         T_max=max_iters - warmup_iters, eta_min_ratio=0.01)
]

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=base_lr, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(
        norm_decay_mult=0.,
        bias_decay_mult=0.,
        custom_keys={
            'absolute_pos_embed': dict(decay_mult=0.),
            'relative_position_bias_table': dict(decay_mult=0.),
        }),
    clip_grad=dict(max_norm=10.0, norm_type=2))

# the runtime's hooks (exact resume, NaN/Inf detection, checks before training) plus the time
# budget (index 0: tools/demo.sh sets its minutes)
custom_hooks = [
    dict(type='TimeBudgetHook', minutes=budget_minutes),
    dict(type='RNGStateHook'),
    dict(type='NonFiniteCheckHook'),
    dict(type='PreflightCheckHook'),
]

# seeded and deterministic: the same iteration count (tools/demo.sh DEMO_ITERS) on the same
# machine gives the same weights; the time budget alone varies the count with the machine load
randomness = dict(seed=0, deterministic=True)
