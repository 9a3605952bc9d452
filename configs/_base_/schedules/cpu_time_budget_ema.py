# The CPU demos' recipe: the time-budget schedule (cpu_time_budget.py) with AdamW at 2e-3 (fused
# kernel) and an EMA of the weights (mmdet's ExpMomentumEMA), which evaluation and the saved
# checkpoint's state_dict use.
_base_ = './cpu_time_budget.py'
optim_wrapper = dict(optimizer=dict(lr=2e-3, fused=True))
custom_hooks = _base_.custom_hooks + [
    dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=0.002, update_buffers=True,
         priority=49),
]
