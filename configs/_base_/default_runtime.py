# Runtime shared by all vitdet_plugin configs (mmdet 3.x defaults + the plugin import).
custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)
default_scope = 'mmdet'

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='AtomicCheckpointHook', interval=1),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='DetVisualizationHook'))

# exact resume (RNG states in checkpoints), NaN/Inf detection in backbone/neck/losses and the
# config / data checks before the first iteration (vitdet_plugin.checks; our tools/train.py
# runs them before building anything and drops this hook, mmdet's own tools run it)
custom_hooks = [dict(type='RNGStateHook'), dict(type='NonFiniteCheckHook'),
                dict(type='PreflightCheckHook')]

# no seed: mmengine draws one and logs it. A repeatable run: tools/train.py --seed N (which also
# turns on deterministic algorithms on CPU), or set seed / deterministic here
randomness = dict(seed=None, deterministic=False)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # timeout: seconds a collective waits for the slowest rank (a hung rank is released after
    # it; vitdet_plugin.engine.dist.DEFAULT_COLLECTIVE_TIMEOUT_S, torch's gloo default)
    dist_cfg=dict(backend='nccl', timeout=1800))

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='DetLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(type='LogProcessor', window_size=50, by_epoch=True)

log_level = 'INFO'
load_from = None
resume = False
