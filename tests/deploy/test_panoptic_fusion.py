"""The runner's numpy steps after a Panoptic FPN graph (``vitdet_plugin/deploy/panoptic.py``)
against mmdet's own: the semantic logits' resizes (``F.interpolate`` as in
``BaseSemanticHead.predict``) and ``HeuristicFusionHead``; the refusal of panoptic detectors the
graph does not repeat. The exported graph itself: ``test_export_two_stage.py``."""
import os.path as osp

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO_ROOT

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import check_exportable
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.panoptic import (FusionConfig, heuristic_fusion, resize_matrix,
                                           semantic_labels)


@pytest.mark.parametrize('out_len,in_len', [(192, 24), (150, 192), (7, 3), (5, 9), (4, 4)])
def test_resize_matrix_is_torch_interpolate(out_len, in_len):
    x = torch.randn(2, in_len, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = F.interpolate(x[None], size=out_len, mode='linear', align_corners=False)[0]
    np.testing.assert_allclose(x.numpy() @ resize_matrix(out_len, in_len).T, ref.numpy(),
                               atol=1e-12)


def test_semantic_labels_are_base_semantic_head_predict():
    """Pad -> crop -> original size as two interpolations (mmdet) vs one matrix each way."""
    logits = torch.randn(3, 24, 32, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
    resized, original, padded = (181, 250), (150, 207), (192, 256)
    ref = F.interpolate(logits[None], size=padded, mode='bilinear', align_corners=False)
    ref = ref[..., :resized[0], :resized[1]]
    ref = F.interpolate(ref, size=original, mode='bilinear', align_corners=False)[0].argmax(0)
    ours = semantic_labels(logits.numpy(), resized, original, 32)
    assert ours.shape == original and (ours == ref.numpy()).all()


def test_fusion_is_mmdets_heuristic_fusion_head():
    """Overlapping, empty, fully covered and small-stuff cases against mmdet's own head."""
    from mmdet.models.seg_heads.panoptic_fusion_heads import HeuristicFusionHead
    from mmengine.config import ConfigDict
    from mmengine.structures import InstanceData
    cfg = FusionConfig(num_things=3, num_stuff=2, mask_overlap=0.5, stuff_area_limit=30,
                       instance_score_thr=0.0, pad_size_divisor=32)
    head = HeuristicFusionHead(num_things_classes=3, num_stuff_classes=2,
                               test_cfg=ConfigDict(mask_overlap=0.5, stuff_area_limit=30))
    rng = np.random.default_rng(0)
    masks = np.zeros((5, 40, 50), bool)
    masks[0, 5:20, 5:25] = True      # laid first
    masks[1, 10:25, 15:40] = True    # overlaps the first by < 50 %: its rest is laid
    masks[2, 6:18, 6:20] = True      # inside the first: dropped
    masks[4, 30:38, 2:48] = True     # masks[3] stays empty: skipped
    labels = np.array([0, 2, 1, 1, 2])
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5], np.float32)
    semantic = rng.integers(0, 3, (40, 50))
    semantic[:, :3] = 1              # a stuff region, large enough
    semantic[0, 45:] = 0             # 5 px of stuff 0 elsewhere: other pixels of label 3 count
    instances = InstanceData(bboxes=torch.zeros(5, 4), scores=torch.from_numpy(scores),
                             labels=torch.from_numpy(labels), masks=torch.from_numpy(masks))
    # mmdet's stuff channels: 0..num_stuff-1 stuff, num_stuff "thing" -> void after the fusion
    seg = torch.from_numpy(np.eye(3)[semantic].transpose(2, 0, 1))
    ref = head.predict([instances], [seg])[0].sem_seg[0].numpy()
    ours = heuristic_fusion(masks.astype(np.uint8), labels, semantic, cfg)
    assert (ours == ref).all()
    assert set(np.unique(ours)) >= {1000, 2002, 3002, cfg.num_classes}  # laid ids, void


def test_panoptic_heads_the_graph_does_not_repeat_are_refused():
    _, model = build_model(osp.join(REPO_ROOT, 'configs', 'swin_mask2former_panoptic.py'),
                           cfg_options={'model.backbone.init_cfg': None})
    with pytest.raises(ValueError, match=r'^Mask2Former has panoptic_head Mask2FormerHead and '
                                         r'panoptic_fusion_head SemanticMaskFormerFusionHead: no '
                                         r'end-to-end export \(panoptic: PanopticFPN/'
                                         r'AllOutputsPanopticFPN with PanopticFPNHead \+ '
                                         r'HeuristicFusionHead only'):
        check_exportable(model)
