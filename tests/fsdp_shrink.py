"""A shipped FSDP config shrunk to a 1-iteration 2-rank CPU run on the shapes data: the
config's model (backbone shrunk as tests/configs/test_configs.py shrinks it, same layout), optimizer
(layer decay) and runner / wrapper, fp32 (bf16 mixed precision is the GPU check kit's)."""
import copy

from mmengine.config import Config

FSDP_CONFIGS = ('configs/dinov3_l_cascade_mask_rcnn_fsdp.py',
                'configs/eva02_l_cascade_mask_rcnn_fsdp.py', 'configs/dinov3_7b_dino_fsdp.py')


def shrunk_fsdp_cfg(path: str, data_root: str, work_dir: str) -> dict:
    from dist_worker import tiny_cfg
    from test_configs import _shrink

    from vitdet_plugin.config import load_config
    cfg = load_config(path)
    model = _shrink(copy.deepcopy(cfg.model))
    with_mask = 'mask_head' in (model.get('roi_head') or {})
    out = tiny_cfg(data_root, work_dir, max_iters=1, ckpt_interval=1, launcher='pytorch',
                   name=path.split('/')[-1][:-3])
    out['model'] = Config(dict(model=model)).to_dict()['model']
    out['train_dataloader']['batch_size'] = 1
    out['train_dataloader']['dataset']['pipeline'] = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True, with_mask=with_mask),
        dict(type='PackDetInputs')]
    out['optim_wrapper'] = Config(dict(o=cfg.optim_wrapper)).to_dict()['o']
    out['param_scheduler'] = None
    out['runner_type'] = cfg.runner_type
    out['model_wrapper_cfg'] = dict(cfg.model_wrapper_cfg, mixed_precision=None)
    out['custom_hooks'] = list(out['custom_hooks']) + [dict(type='FsdpRecorder')]
    return out
