"""A Swin detector under FSDP2 on 2 gloo ranks: it trains and then validates (the ViT's sharded
run is tests/engine/test_fsdp.py's).

One torchrun job runs this file as its per-rank worker: the tiny Swin RetinaNet of
``dist_worker.tiny_cfg`` under ``FSDP2Runner`` (every ``SwinBlock`` sharded), 2 iterations of
one image per rank, then mmengine's end-of-training validation with ``CocoMetric`` on the
training images. The validation forward is an eval, no-grad forward of the sharded model.
"""
import json
import math
import os
import os.path as osp
import subprocess
import sys
from typing import List

from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
WORLD_SIZE = 2
TRAIN_ITERS = 2
JOB_TIMEOUT_S = 240
#: The metric every rank's validation reports (CocoMetric gathers the results of both ranks).
METRIC = 'coco/bbox_mAP'


def swin_fsdp_cfg(data_root: str, work_dir: str) -> dict:
    """The tiny Swin RetinaNet, sharded by FSDP2Runner, validated at the end of training."""
    from dist_worker import IMAGE_SIZE, tiny_cfg
    from vitdet_plugin.datasets import CLASSES
    cfg = tiny_cfg(data_root, work_dir, max_iters=TRAIN_ITERS, ckpt_interval=TRAIN_ITERS,
                   name='fsdp_swin', launcher='pytorch',
                   custom_hooks=[dict(type='FsdpRecorder')])
    cfg['runner_type'] = 'FSDP2Runner'
    cfg['model']['test_cfg']['score_thr'] = 0.0  # an untrained head scores ~0.01: keep its boxes
    cfg['train_dataloader']['batch_size'] = 1
    cfg['train_cfg']['val_interval'] = TRAIN_ITERS
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True),
                dict(type='Resize', scale=(IMAGE_SIZE, IMAGE_SIZE), keep_ratio=True),
                dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape',
                                                      'img_shape', 'scale_factor'))]
    ann_file = 'annotations/instances_train.json'
    cfg['val_dataloader'] = dict(
        batch_size=1, num_workers=0, sampler=dict(type='DefaultSampler', shuffle=False),
        dataset=dict(type='CocoDataset', data_root=data_root, ann_file=ann_file,
                     data_prefix=dict(img='train/'), metainfo=dict(classes=CLASSES),
                     test_mode=True, pipeline=pipeline))
    cfg['val_evaluator'] = dict(type='CocoMetric', ann_file=osp.join(data_root, ann_file),
                                metric='bbox')
    cfg['val_cfg'] = dict(type='ValLoop')
    return cfg


def worker(data_root: str, work: str) -> None:
    """One rank: train and validate, then write ``rank{r}.json``."""
    import torch

    import vitdet_plugin  # noqa: F401
    from fsdp_worker import _recorder, _runner, register_recorder
    torch.set_num_threads(1)
    register_recorder()
    from mmengine.hooks import Hook
    validations: List[dict] = []

    class MetricsHook(Hook):
        """Keeps the metrics of every validation."""

        def after_val_epoch(self, runner, metrics=None) -> None:
            validations.append(dict(metrics or {}))

    runner = _runner(swin_fsdp_cfg(data_root, osp.join(work, 'run')))
    runner.register_hook(MetricsHook(), priority='LOWEST')
    runner.train()
    result = dict(wrapper=type(runner.model).__name__,
                  sharded=sorted({type(m).__name__ for m in runner.model.modules()
                                  if hasattr(m, 'unshard')}),
                  param_types=sorted({type(p).__name__ for p in runner.model.parameters()}),
                  losses=_recorder(runner).losses, metrics=validations)
    with open(osp.join(work, f'rank{os.environ["RANK"]}.json'), 'w') as f:
        json.dump(result, f)


def test_swin_detector_trains_and_validates_under_fsdp2_on_two_ranks(tmp_path):
    from dist_worker import make_data
    from test_distributed import _free_port
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           osp.join(ROOT, 'tests', 'engine'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD_SIZE}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           osp.abspath(__file__), data, work]
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    ranks = [json.load(open(osp.join(work, f'rank{r}.json'))) for r in range(WORLD_SIZE)]
    for res in ranks:
        assert res['wrapper'] == 'FSDP2Wrapper'
        assert res['param_types'] == ['DTensor']
        assert res['sharded'] == ['FSDPRetinaNet', 'FSDPSwinBlock'], res['sharded']
        assert len(res['losses']) == TRAIN_ITERS and all(map(math.isfinite, res['losses']))
        assert len(res['metrics']) == 1, res['metrics']  # the end-of-training validation
        assert math.isfinite(res['metrics'][0][METRIC]), res['metrics']
    assert ranks[0]['metrics'] == ranks[1]['metrics']  # gathered: one result for both ranks
    assert ranks[0]['losses'] != ranks[1]['losses']  # each rank trained on its own image


if __name__ == '__main__':
    worker(*sys.argv[1:3])
