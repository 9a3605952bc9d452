"""End-to-end ONNX export of Panoptic FPN (``make demo-seg``'s detector): the graph's instances
and semantic logits, the runner's numpy resize + heuristic fusion (``deploy/panoptic.py``)
against mmdet's own ``predict`` (``pred_panoptic_seg``), on the shrunk demo config with random
weights; the fusion's pieces against mmdet's ``F.interpolate`` and ``HeuristicFusionHead``; the
refusal of panoptic detectors the graph does not repeat."""
import os.path as osp

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO_ROOT
from test_export_two_stage import _images, perturb_

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import (EndToEndDetector, add_metadata, check_exportable,
                                             export_end_to_end, pipeline_meta)
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, MASK_IOU_TOLERANCE,
                                                   PANOPTIC_TOLERANCE, SCORE_TOLERANCE,
                                                   compare)
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.panoptic import (INSTANCE_OFFSET, SEMANTIC_OUTPUT, FusionConfig,
                                           heuristic_fusion, resize_matrix, semantic_labels)
from vitdet_plugin.deploy.runner import OnnxDetector

CONFIG = 'configs/demo/swin_panoptic_fpn_shapes.py'
#: The shrunk demo; a low instance threshold so random-weight detections enter the fusion.
OPTIONS = {'model.backbone.depths': [1, 1, 1], 'model.roi_head.bbox_head.fc_out_channels': 32,
           'model.roi_head.mask_head.num_convs': 1, 'model.backbone.init_cfg': None,
           'model.test_cfg.panoptic.instance_score_thr': 0.05,
           'model.test_cfg.panoptic.stuff_area_limit': 200}
#: Scale of the semantic head's classifier after perturb_ (spread-out logits, few ties).
SEMANTIC_SCALE = 4.0


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    cfg, model = build_model(osp.join(REPO_ROOT, CONFIG), cfg_options=dict(OPTIONS))
    perturb_(model)
    with torch.no_grad():
        model.semantic_head.conv_logits.weight.mul_(SEMANTIC_SCALE)
    module = EndToEndDetector(model)
    path = str(tmp_path_factory.mktemp('panoptic') / 'model.onnx')
    export_end_to_end(module, path)
    add_metadata(path, pipeline_meta(cfg, module))
    return model, module, path


def test_graph_and_fusion_match_mmdet_predict(exported):
    """Instances (boxes, scores, labels, masks) and the panoptic map through the runner's
    fusion equal mmdet's predict at three sizes (two with padding inside the graph)."""
    model, module, path = exported
    session = ort_session(path)
    names = [o.name for o in session.get_outputs()]
    assert names[-1] == SEMANTIC_OUTPUT and module.panoptic
    things = stuff = 0
    for p, image in zip(compare(session, model, _images()), _images()):
        assert p.num_onnx == p.num_torch > 0, p
        assert p.box_error <= BOX_TOLERANCE and p.score_error <= SCORE_TOLERANCE, p
        assert p.labels_equal and p.mask_iou >= MASK_IOU_TOLERANCE, p
        assert p.panoptic_agreement >= PANOPTIC_TOLERANCE, p
        sem = session.run(None, {'image': image[None].numpy()})[-1]
        assert sem.shape == (1, 3, *(-(-s // 32) * 32 // 8 for s in p.size))  # stride 8, padded
        from vitdet_plugin.deploy.end_to_end_check import mmdet_instances
        pan = mmdet_instances(model, image)[4]
        things += int((pan >= INSTANCE_OFFSET).any())
        stuff += int(((pan < INSTANCE_OFFSET) & (pan >= 5) & (pan < 7)).any())
    assert things and stuff  # the maps compared hold instances and stuff


def test_runner_resizes_back_to_the_original_image(exported):
    """An image the test pipeline resizes (192 px): the runner's panoptic map at the original
    size equals mmdet's predict with rescale through the config's test pipeline."""
    from mmdet.apis import inference_detector
    model, _, path = exported
    model.cfg = _test_cfg()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 64, (150, 230, 3), dtype=np.uint8)
    image[30:90, 40:120] = 220
    ours = OnnxDetector(path)(image)
    ref = inference_detector(model, image)
    pan = ref.pred_panoptic_seg.sem_seg[0].numpy()
    assert ours.panoptic is not None and ours.panoptic.shape == pan.shape == (150, 230)
    assert (ours.panoptic == pan).mean() >= PANOPTIC_TOLERANCE
    assert len(ours.scores) == len(ref.pred_instances.scores)


def _test_cfg():
    from vitdet_plugin.config import load_config
    cfg = load_config(osp.join(REPO_ROOT, CONFIG), dict(OPTIONS))
    cfg.test_dataloader.dataset.pipeline = [
        t for t in cfg.test_dataloader.dataset.pipeline if t['type'] != 'LoadPanopticAnnotations']
    return cfg


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
