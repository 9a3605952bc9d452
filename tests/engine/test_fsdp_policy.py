"""configs/_base_/fsdp.py exactly as shipped (bf16 mixed precision, fp32 reduction, activation
checkpointing) on 2 gloo ranks: a plain ViT and a ViT with a BatchNorm conv stem each train one
iteration and validate with mmdet's own ``CocoMetric``, which gets fp32 predictions (it calls
``.numpy()``, which has no bf16); the BatchNorm computes with fp32 weights and running
statistics on the bf16 activations, in training and in eval mode.
"""
import json
import math
import os
import os.path as osp

import torch
from dist_worker import make_data
from fsdp_worker import FSDP_POLICY
from mmdet.structures import DetDataSample
from mmengine.config import Config
from mmengine.structures import InstanceData
from test_fsdp import JOB_TIMEOUT_S, WORLD_SIZE, torchrun

from vitdet_plugin.engine.fsdp import predictions_to_fp32

#: the keys of mmdet's CocoMetric (bbox) result
COCO_KEYS = ['bbox_mAP', 'bbox_mAP_50', 'bbox_mAP_75', 'bbox_mAP_s', 'bbox_mAP_m', 'bbox_mAP_l']


def test_shipped_policy_trains_and_validates_vit_and_batchnorm_on_two_ranks(tmp_path):
    shipped = Config.fromfile(FSDP_POLICY).model_wrapper_cfg
    assert shipped.mixed_precision == dict(param_dtype='bfloat16', reduce_dtype='float32')
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    job = torchrun('policy', data, work, timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    assert 'terminate called' not in job.stderr
    ranks = [json.load(open(osp.join(work, f'policy{r}.json'))) for r in range(WORLD_SIZE)]
    for r, res in enumerate(ranks):
        for name in ('vit', 'bn'):
            run = res[name]
            assert run['iter'] == 1 and math.isfinite(run['losses'][0]), (r, name, run)
            # the policy is in force: a backbone Linear computes in bf16 ...
            for mode in ('train', 'eval'):
                assert run['seen'][f'linear {mode}'] == ['torch.bfloat16'] * 2, (r, name)
            # ... and the predictions reach the metric in fp32
            assert run['dtypes'] == ['torch.float32'], (r, name, run['dtypes'])
        # BatchNorm: fp32 weight on the bf16 input, fp32 running statistics that trained
        bn = res['bn']
        assert bn['norms'] == 1
        for mode in ('train', 'eval'):
            assert bn['seen'][f'bn {mode}'] == ['torch.float32', 'torch.bfloat16'], (r, bn)
        (dtype, moved), = bn['running']
        assert dtype == 'torch.float32' and moved > 0, (r, bn['running'])
    for name in ('vit', 'bn'):  # rank 0 computes the metric (score_thr 0: boxes to score)
        assert sorted(ranks[0][name]['metric']) == sorted(COCO_KEYS), ranks[0][name]
        assert 0 <= ranks[0][name]['metric']['bbox_mAP'] <= 1


def test_predictions_to_fp32_casts_low_precision_floats_only():
    sample = DetDataSample(metainfo=dict(img_shape=(8, 8)))
    sample.pred_instances = InstanceData(
        bboxes=torch.tensor([[1.5, 2.25, 3.0, 4.125]], dtype=torch.bfloat16),
        scores=torch.tensor([0.75], dtype=torch.float16),
        labels=torch.tensor([2]), masks=torch.ones(1, 2, 2, dtype=torch.bool))
    out, = predictions_to_fp32([sample])
    assert out is sample
    pred = out.pred_instances
    assert (pred.bboxes.dtype, pred.scores.dtype) == (torch.float32, torch.float32)
    assert pred.bboxes.tolist() == [[1.5, 2.25, 3.0, 4.125]] and pred.scores.tolist() == [0.75]
    assert (pred.labels.dtype, pred.masks.dtype) == (torch.int64, torch.bool)
    assert out.metainfo['img_shape'] == (8, 8)
    double = torch.zeros(2, dtype=torch.float64)
    assert predictions_to_fp32({'x': double})['x'] is double
