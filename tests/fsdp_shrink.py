"""A shipped FSDP config shrunk to a 1-iteration 2-rank CPU run on the shapes data: the
config's model (backbone shrunk as tests/configs/test_configs.py shrinks it, same layout), optimizer
(layer decay) and runner / wrapper; RF-DETR's with the shipped bf16 FSDP2 policy, the large
configs fp32 (their bf16 runs are the GPU check kit's). A config without FSDP runs the same way
under DDP (tests/engine/test_rfdetr_distributed.py)."""
import copy
import os.path as osp
import sys

from mmengine.config import Config

#: tests/configs (test_configs' _shrink): on the path of the torchrun workers too, whose
#: PYTHONPATH has tests/ only (tests/conftest.py puts every tests/ folder on pytest's own path)
CONFIG_TESTS = osp.join(osp.dirname(osp.abspath(__file__)), 'configs')

FSDP_CONFIGS = ('configs/dinov3_l_cascade_mask_rcnn_fsdp.py',
                'configs/eva02_l_cascade_mask_rcnn_fsdp.py', 'configs/dinov3_7b_dino_fsdp.py')


def shrunk_fsdp_cfg(path: str, data_root: str, work_dir: str) -> dict:
    from dist_worker import tiny_cfg
    if CONFIG_TESTS not in sys.path:
        sys.path.insert(0, CONFIG_TESTS)
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
    # the one iteration is an optimizer step, its gradients reduced over the ranks (RF-DETR's
    # configs accumulate 4 iterations: DDP would skip the reduction of the first three)
    out['optim_wrapper'].pop('accumulative_counts', None)
    out['param_scheduler'] = None
    # a config without FSDP (RF-DETR's) runs under mmengine's Runner: DDP
    out['runner_type'] = cfg.get('runner_type', 'Runner')
    if 'model_wrapper_cfg' in cfg:
        # RF-DETR's keeps the shipped bf16 policy (bf16 parameters, no autocast: the dtype seam
        # a user's FSDP2 run crosses); the large configs run fp32 here
        keep = 'rfdetr' in osp.basename(path)
        out['model_wrapper_cfg'] = dict(cfg.model_wrapper_cfg, **(
            {} if keep else dict(mixed_precision=None)))
    out['custom_hooks'] = list(out['custom_hooks']) + [dict(type='FsdpRecorder')]
    return out
