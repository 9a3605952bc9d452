"""AllOutputsPanopticFPN: one predict pass gives the instances (all of them), the panoptic map
(the confident ones fused with the stuff map) and the semantic map, on hand-made head outputs."""
import os.path as osp

import torch
from mmengine.structures import InstanceData

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import load_config
from vitdet_plugin.models.detectors.panoptic_fpn import IGNORE_INDEX
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
DEMO = osp.join(ROOT, 'configs', 'demo', 'swin_panoptic_fpn_shapes.py')
H, W = 8, 12
OFFSET = 1000  # mmdet's INSTANCE_OFFSET, written out: the encoding the metrics expect


def _model():
    from mmdet.registry import MODELS
    cfg = load_config(DEMO)
    cfg.model.test_cfg.panoptic.update(stuff_area_limit=4, instance_score_thr=0.5)
    return MODELS.build(cfg.model).eval()


def test_predict_keeps_instances_fuses_confident_ones_and_writes_semantic_map(monkeypatch):
    from mmdet.structures import DetDataSample
    model = _model()
    things, stuff = 5, 2  # labels 0-4 shapes, 5 lines, 6 background
    masks = torch.zeros(2, H, W, dtype=torch.bool)
    masks[0, 1:4, 1:4] = True   # confident star (label 3)
    masks[1, 5:8, 8:12] = True  # unsure circle (label 1): mAP sees it, the fusion does not
    inst = InstanceData(bboxes=torch.tensor([[1., 1., 4., 4.], [8., 5., 12., 8.]]),
                        scores=torch.tensor([0.9, 0.3]), labels=torch.tensor([3, 1]),
                        masks=masks)
    # stuff head logits (lines, background, things): lines in row 0, things in column 11,
    # background elsewhere
    seg = torch.zeros(stuff + 1, H, W)
    seg[1] = 1.0
    seg[0, 0, :] = 5.0
    seg[2, 1:7, 11] = 5.0
    monkeypatch.setattr(model, 'extract_feat', lambda x: None)
    monkeypatch.setattr(model.rpn_head, 'predict', lambda *a, **k: [None])
    monkeypatch.setattr(model.roi_head, 'predict', lambda *a, **k: [inst])
    monkeypatch.setattr(model.semantic_head, 'predict', lambda *a, **k: [seg])
    sample = DetDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W)))
    out = model.predict(torch.zeros(1, 3, H, W), [sample])[0]

    assert torch.equal(out.pred_instances.scores, inst.scores)  # every detection, for mAP
    pan = out.pred_panoptic_seg.sem_seg[0]
    expected = torch.full((H, W), things + 1)                 # background
    expected[0, :] = things                                   # lines
    expected[1:7, 11] = things + stuff                        # "things" without an instance: void
    expected[1:4, 1:4] = 3 + OFFSET                           # the confident star, instance 1
    assert torch.equal(pan, expected)
    sem = out.pred_sem_seg.sem_seg[0]
    want = expected % OFFSET
    want[want == things + stuff] = IGNORE_INDEX
    assert torch.equal(sem, want)
    assert out.pred_sem_seg.ignore_index == IGNORE_INDEX
