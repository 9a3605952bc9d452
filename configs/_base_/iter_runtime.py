# Runtime for iteration-based training (IterBasedTrainLoop): iteration logging, one checkpoint
# at the end of training (CheckpointHook saves the last iteration), iteration-indexed logs.
_base_ = './default_runtime.py'

custom_imports = dict(imports=['vitdet_plugin'],
                      allow_failed_imports=False)
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=25),
    checkpoint=dict(type='AtomicCheckpointHook', by_epoch=False, interval=100000, max_keep_ckpts=1))
log_processor = dict(type='LogProcessor', window_size=25, by_epoch=False)
