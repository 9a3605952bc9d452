"""transformers' ``RfDetrForObjectDetection`` (transformers 5.25) folders, written by its own
``save_pretrained``: transformers saves rfdetr's own names, so RF-DETR's layout reads the folder;
its ``num_labels`` logits are each a class of ``id2label`` (no no-object slot), which the
converter keeps as saved. The folder converts with ``tools/convert_weights.py`` and loads into
the RF-DETR config of its size. Our ``predict`` on the same batch (labels equal, scores within
1e-4, boxes within 1e-3 of the side, the reference's boxes clipped to the image as mmdet's) is
compared with transformers' ``post_process_object_detection`` at N (384 px) and, at S (512 px),
with rfdetr's own ``RFDETRSmall`` loaded from the same folder: on this draw transformers' own
forward at S differs from rfdetr's on the same weights (a box by 5.5e-3 of the side, scores by
3e-4), ours does not (4.8e-7). The models are random (every parameter, seeded), 5 labels."""
import os
import re
from typing import Dict, List, Tuple

import pytest
import torch
from helpers import REPO_ROOT, randomize_, run_tool
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
from mmdet.utils import register_all_modules
from mmengine.config import Config
from safetensors.torch import load_file
from transformers import (LwDetrConfig, LwDetrForObjectDetection, RfDetrConfig,
                          RfDetrForInstanceSegmentation, RfDetrForObjectDetection,
                          RfDetrImageProcessor)
from transformers.models.rf_detr.configuration_rf_detr import RfDetrDinov2Config

import rfdetr

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights import CheckpointError, detect_layout
from vitdet_plugin.weights.common import checkpoint_state_dict

register_all_modules()
LABELS = 5
#: size -> (config, resolution, decoder layers): RF-DETR's N and S (rfdetr's config.py).
SIZES: Dict[str, Tuple[str, int, int]] = {'N': ('configs/rfdetr/rfdetr_nano.py', 384, 2),
                                          'S': ('configs/rfdetr/rfdetr_small.py', 512, 3)}
#: The comparison's tolerances (transformers' and our forward differ by float rounding).
SCORE_TOL = 1e-4
BOX_SIDE_TOL = 1e-3
#: The first group's proposal classifier scaled by this: random weights crowd the ranking
#: logits of the tokens, and two that tie within rounding may swap which token becomes a
#: query (a swap shifts every query's score through the decoder's self-attention).
PROPOSAL_SPREAD = 20.0
#: Detections compared, best first.
TOP = 100


def _transformers_rfdetr(resolution: int, layers: int) -> RfDetrForObjectDetection:
    """transformers' RF-DETR of rfdetr's sizes: ViT-S/16 DINOv2, 2 x 2 windows, taps after
    blocks 3, 6, 9, 12, one projector level, 2 sampling points, 300 queries x 13 groups."""
    backbone = RfDetrDinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                  image_size=resolution, patch_size=16, num_windows=2,
                                  out_indices=[3, 6, 9, 12])
    config = RfDetrConfig(backbone_config=backbone, decoder_layers=layers, decoder_n_points=2,
                          num_labels=LABELS)
    model = randomize_(RfDetrForObjectDetection(config)).eval()
    with torch.no_grad():  # proposals ranked far apart: no two tie within float rounding
        model.model.enc_out_class_embed[0].weight.mul_(PROPOSAL_SPREAD)
    return model


@pytest.fixture(scope='module')
def folders(tmp_path_factory) -> Dict[str, Tuple[str, RfDetrForObjectDetection]]:
    out = {}
    for size, (_, resolution, layers) in SIZES.items():
        model = _transformers_rfdetr(resolution, layers)
        folder = str(tmp_path_factory.mktemp(f'hf_rfdetr_{size}'))
        model.save_pretrained(folder)
        out[size] = (folder, model)
    return out


def test_the_folder_is_detected_as_rfdetr(folders):
    layout = detect_layout(checkpoint_state_dict(folders['N'][0]))
    assert layout.describe() == 'an RF-DETR checkpoint (rfdetr layout)'


def _reference(size: str, folder: str, theirs: RfDetrForObjectDetection, inputs: torch.Tensor,
               shape: Tuple[int, int]) -> List[Dict[str, torch.Tensor]]:
    """The reference's detections: transformers' post-processing (N), or rfdetr's own model of
    the size with the folder's weights and its ``PostProcess`` (S)."""
    with torch.no_grad():
        if size == 'N':
            return RfDetrImageProcessor().post_process_object_detection(
                theirs(pixel_values=inputs), threshold=0.0, target_sizes=[shape] * len(inputs))
        reference = rfdetr.RFDETRSmall(pretrain_weights=None, num_classes=LABELS - 1)
        net = reference.model.model.eval()
        net.load_state_dict({**net.state_dict(), **load_file(
            os.path.join(folder, 'model.safetensors'))}, strict=True)
        return reference.model.postprocess(net(inputs), torch.tensor([shape] * len(inputs)))


@pytest.mark.parametrize('size', ['N', 'S'])
def test_predictions_equal_the_references(folders, size, tmp_path):
    folder, theirs = folders[size]
    config, resolution, _ = SIZES[size]
    out = str(tmp_path / 'ours.pth')
    res = run_tool('convert_weights.py', [folder, out])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(
        f"load it with load_from='{out}' in {config} with --cfg-options "
        f"model.bbox_head.num_classes={LABELS} (the checkpoint's classes, in rfdetr's order: "
        "'LABEL_0', 'LABEL_1', 'LABEL_2', 'LABEL_3', 'LABEL_4')")
    cfg = Config.fromfile(str(REPO_ROOT / config))
    cfg.model.bbox_head.num_classes = LABELS
    ours = MODELS.build(cfg.model).eval()
    ours.load_state_dict(torch.load(out, weights_only=True)['state_dict'], strict=True)

    gen = torch.Generator().manual_seed(resolution)
    images = list((torch.rand(2, 3, resolution, resolution, generator=gen) * 255).to(torch.uint8))
    shape = (resolution, resolution)
    samples = [DetDataSample(metainfo=dict(img_shape=shape, ori_shape=shape,
                                           scale_factor=(1.0, 1.0))) for _ in images]
    data = ours.data_preprocessor(dict(inputs=images, data_samples=samples), False)
    with torch.no_grad():
        results = ours.predict(data['inputs'], data['data_samples'])
    expected = _reference(size, folder, theirs, data['inputs'], shape)
    for result, want in zip(results, expected):
        pred = result.pred_instances
        labels, scores, boxes = pred.labels[:TOP], pred.scores[:TOP], pred.bboxes[:TOP]
        assert float((scores - want['scores'][:TOP]).abs().max()) <= SCORE_TOL
        # mmdet clips boxes to the image, transformers does not; detections of one score
        # (within the tolerance) may come in either order
        clipped = want['boxes'][:TOP].clamp(0, resolution)
        box_err = ((boxes[:, None] - clipped[None]).abs() / resolution).amax(-1)
        same = ((labels[:, None] == want['labels'][None, :TOP])
                & ((scores[:, None] - want['scores'][None, :TOP]).abs() <= SCORE_TOL)
                & (box_err <= BOX_SIDE_TOL))
        assert bool(same.any(1).all()), f'ranks {(~same.any(1)).nonzero().flatten().tolist()}'
        score_err = float((scores - want['scores'][:TOP]).abs().max())
        matched_box_err = float(box_err.masked_fill(~same, 1).amin(1).max())
        print(f'RF-DETR {size} {resolution} px: scores {score_err:.2g}, boxes (of the side) '
              f'{matched_box_err:.2g}')


def test_a_folder_of_another_size_is_refused_naming_its_config(folders, tmp_path):
    cfg = Config.fromfile(str(REPO_ROOT / SIZES['N'][0]))
    backbone = MODELS.build(dict(cfg.model.backbone, init_cfg=dict(
        type='Pretrained', checkpoint=folders['S'][0])))
    want = ('the checkpoint is an RF-DETR S of patch 16, ViT width 384, position grid 32x32 '
            '(512 px); DINOv2Backbone was built with position grid 24x24 (384 px): build it '
            'from configs/rfdetr/rfdetr_small.py')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        backbone.init_weights()


#: RF-DETR-Seg sizes (rfdetr 1.11.2: patch 12, 4 decoder layers, 100 queries): config,
#: resolution, windows.
SEG_SIZES = {'N-Seg': ('configs/rfdetr/rfdetr_seg_nano.py', 312, 1),
             'S-Seg': ('configs/rfdetr/rfdetr_seg_small.py', 384, 2)}


def _seg_folder(size: str, folder: str) -> RfDetrForInstanceSegmentation:
    """transformers' ``RfDetrForInstanceSegmentation`` of ``size`` (random, proposals spread),
    saved to ``folder`` with its ``save_pretrained``."""
    _, resolution, windows = SEG_SIZES[size]
    backbone = RfDetrDinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                  image_size=resolution, patch_size=12, num_windows=windows,
                                  out_indices=[3, 6, 9, 12])
    theirs = randomize_(RfDetrForInstanceSegmentation(RfDetrConfig(
        backbone_config=backbone, decoder_layers=4, decoder_n_points=2, num_queries=100,
        num_labels=LABELS))).eval()
    with torch.no_grad():
        theirs.model.model.enc_out_class_embed[0].weight.mul_(PROPOSAL_SPREAD)
    theirs.save_pretrained(folder)
    return theirs


@pytest.mark.parametrize('size', [
    'N-Seg', pytest.param('S-Seg', marks=pytest.mark.slow)])
def test_an_instance_segmentation_folder_predicts_as_transformers(size, tmp_path):
    """``RfDetrForInstanceSegmentation`` folders in the seg configs: N-Seg converted by
    ``tools/convert_weights.py`` (which names the config) and loaded strictly, S-Seg read as the
    folder by the export tool's loader (``tools/test.py``'s path). Our final layer's logits,
    boxes and mask logits equal transformers' and ``predict`` equals transformers' top-k over
    queries x classes with its masks resized as its ``post_process_instance_segmentation``
    (ties as in the whole-model parity test)."""
    from test_rfdetr_model_parity import HEAD_TOL, MASK_PIXEL_TOL, _mask_diff, _match

    from vitdet_plugin.deploy.onnx_export import build_model

    config, resolution, _ = SEG_SIZES[size]
    folder = str(tmp_path / 'seg')
    theirs = _seg_folder(size, folder)
    options = {'model.bbox_head.num_classes': LABELS}
    if size == 'N-Seg':
        out = str(tmp_path / 'seg_ours.pth')
        res = run_tool('convert_weights.py', [folder, out])
        assert res.returncode == 0, res.stderr
        assert f'in {config} with --cfg-options' in res.stdout
        ours = build_model(str(REPO_ROOT / config), cfg_options=options)[1]
        ours.load_state_dict(torch.load(out, weights_only=True)['state_dict'], strict=True)
    else:
        ours = build_model(str(REPO_ROOT / config), folder, cfg_options=options)[1]

    shape = (resolution, resolution)
    gen = torch.Generator().manual_seed(resolution)
    images = list((torch.rand(2, 3, *shape, generator=gen) * 255).to(torch.uint8))
    samples = [DetDataSample(metainfo=dict(img_shape=shape, ori_shape=shape,
                                           scale_factor=(1.0, 1.0))) for _ in images]
    data = ours.data_preprocessor(dict(inputs=images, data_samples=samples), False)
    with torch.no_grad():
        want = theirs(pixel_values=data['inputs'])
        outs = ours.bbox_head(ours.extract_feat(data['inputs']), [s.metainfo for s in samples])
        results = ours.predict(data['inputs'], data['data_samples'])
    assert float((outs.det.all_cls_scores[-1] - want.logits).abs().max()) <= HEAD_TOL
    assert float((outs.det.all_bbox_preds[-1] - want.pred_boxes).abs().max()) <= HEAD_TOL
    mask_logits = outs.masks.logits(-1)                                     # (B, Q, Hm, Wm)
    assert float((mask_logits - want.pred_masks).abs().max()
                 / want.pred_masks.abs().max().clamp_min(1)) <= HEAD_TOL

    side = torch.tensor(float(resolution))
    top = len(results[0].pred_instances)
    scores, index = want.logits.sigmoid().flatten(1).topk(top, dim=1)       # (B, top)
    for b, result in enumerate(results):
        queries = index[b] // LABELS
        boxes = bbox_cxcywh_to_xyxy(want.pred_boxes[b, queries] * side).clamp(0, side)
        masks = torch.nn.functional.interpolate(want.pred_masks[b, queries][:, None], size=shape,
                                                mode='bilinear', align_corners=False)[:, 0] > 0
        ref = dict(labels=index[b] % LABELS, scores=scores[b], boxes=boxes, masks=masks)
        _match(result.pred_instances, ref, side)
        assert _mask_diff(result.pred_instances, ref) <= MASK_PIXEL_TOL


def test_an_lw_detr_folder_is_refused_naming_what_converts(tmp_path):
    """LW-DETR (``LwDetrForObjectDetection``): its own ViT backbone, which no backbone of ours
    builds."""
    folder = str(tmp_path / 'lw_detr')
    LwDetrForObjectDetection(LwDetrConfig()).save_pretrained(folder)
    res = run_tool('convert_weights.py', [folder, str(tmp_path / 'out.pth')])
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f'error: {folder} is a transformers LwDetrForObjectDetection folder: LW-DETR, whose '
        "backbone is LW-DETR's own ViT, which no backbone of ours builds (configs/rfdetr build "
        "RF-DETR's DINOv2); convert an RF-DETR folder (RfDetrForObjectDetection) or rfdetr's "
        '.pth')
