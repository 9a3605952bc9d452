"""End-to-end ONNX export of RF-DETR-Seg (``LWDETRSegHead``'s own test path traced): the tiny
RF-DETR of ``test_export_rfdetr.py`` with the seg head and RF-DETR's test resize
(``RFDETRResize`` to a fixed size, inside the graph), seeded random weights. The graph's masks
must equal mmdet's ``predict`` masks except at pixels whose resized logit is within
:data:`BOUNDARY_LOGIT` of 0 (the same bilinear weights, rounded differently): both lie between
the masks of the graph's logits shifted down and up by it (a shift of every logit shifts the
resized one by as much). Default suite: the graph's module in PyTorch vs ``predict`` on a
padded batch and resizing inside; a resize outside the graph refused; slow: exported through
``tools/export_onnx.py --part detector``, onnxruntime vs ``predict`` at three sizes, the runner
on an image of another size vs ``predict`` with ``rescale``, and ``tools/infer.py``'s masks
onnxruntime vs pytorch backend."""
import json

import cv2
import numpy as np
import pytest
import torch
from helpers import load_tool, randomize_
from mmengine.config import Config
from test_export_rfdetr import (CONFIG, MAX_PER_IMG, SIZES, WEIGHT_SEED, _images,
                                export_through_tool)

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import OUTPUT_NAMES, EndToEndDetector, pipeline_meta
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, SCORE_TOLERANCE,
                                                   mmdet_instances, untied)
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.runner import SEG_MASK_OUTPUTS, OnnxDetector
from vitdet_plugin.models.heads.lwdetr_seg_head import masks_to_image

#: The detection test's tiny RF-DETR with RF-DETR-Seg's head (mask branch on P4, 2 layers).
SEG_HEAD = "_base_ = '{base}'\nmodel = dict(bbox_head=dict(type='LWDETRSegHead'))\n"
#: The network's input (h, w): RFDETRResize (scale is mmdet's (w, h)) resizes every image to it.
NETWORK_SIZE = (128, 96)
#: ... with RF-DETR's test pipeline: the resize inside the graph.
SEG_CONFIG = SEG_HEAD + f"""test_dataloader = dict(dataset=dict(pipeline=[
    dict(type='LoadImageFromFile'),
    dict(type='RFDETRResize', scale={NETWORK_SIZE[::-1]}, keep_ratio=False),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]))
"""
#: A mask pixel may differ from mmdet's only where the resized logit is this close to 0.
BOUNDARY_LOGIT = 1e-4
#: The tiny config's pad_size_divisor.
PAD = 32


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    folder = tmp_path_factory.mktemp('rfdetr_seg_cfg')
    (folder / 'tiny_rfdetr.py').write_text(CONFIG)
    path = folder / 'tiny_rfdetr_seg.py'
    path.write_text(SEG_CONFIG.format(base=folder / 'tiny_rfdetr.py'))
    return str(path)


@pytest.fixture(scope='module')
def model(config):
    return randomize_(build_model(config)[1], seed=WEIGHT_SEED).eval()


def _padded(size):
    return tuple(-(-s // PAD) * PAD for s in size)


def assert_masks_match(masks, logits, ref_masks, size, out=None):
    """``masks`` (graph or runner) and ``ref_masks`` (mmdet) both between the masks of the
    graph's ``logits`` shifted by -+ :data:`BOUNDARY_LOGIT`, resized from the input ``size`` to
    ``out``; returns the number of pixels where they differ."""
    out = out or size
    meta = dict(batch_input_shape=_padded(size), img_shape=size, ori_shape=out)
    low, high = (masks_to_image(torch.from_numpy(logits + shift), meta, True).numpy()
                 for shift in (-BOUNDARY_LOGIT, BOUNDARY_LOGIT))
    for m in (masks.astype(bool), ref_masks.astype(bool)):
        assert not (low.astype(bool) & ~m).any() and not (m & ~high.astype(bool)).any()
    assert 0 < ref_masks.mean() < 1   # masks neither all empty nor all full
    return int((masks.astype(bool) != ref_masks.astype(bool)).sum())


def assert_detections_match(boxes, scores, labels, ref, atol_box):
    ref_boxes, ref_scores, ref_labels = ref[:3]
    assert len(scores) == len(ref_scores) == MAX_PER_IMG
    np.testing.assert_allclose(scores, ref_scores, atol=SCORE_TOLERANCE, rtol=0)
    ranks = untied(ref_scores)
    assert ranks.all()   # no ties: every mask is compared at its rank
    np.testing.assert_allclose(boxes, ref_boxes, atol=atol_box, rtol=0)
    assert np.array_equal(labels, ref_labels)


def test_module_matches_mmdet_predict_in_pytorch(model):
    """The graph's module before export on a padded batch of two (70 x 90 -> 96 x 96) vs
    mmdet's predict per image, masks included."""
    module = EndToEndDetector(model).eval()
    assert module.kind == 'lwdetr' and module.output_names == [*OUTPUT_NAMES, *SEG_MASK_OUTPUTS]
    images = _images(2, [(70, 90), (70, 90)])
    with torch.no_grad():
        boxes, scores, labels, num, masks, logits = module(torch.stack(images))
    assert masks.shape == (2, MAX_PER_IMG, 70, 90) and masks.dtype == torch.uint8
    assert logits.shape == (2, MAX_PER_IMG, 96 // 4, 96 // 4)
    for b, image in enumerate(images):
        ref = mmdet_instances(model, image)
        assert int(num[b]) == MAX_PER_IMG
        assert_detections_match(boxes[b].numpy(), scores[b].numpy(), labels[b].numpy(), ref,
                                1e-4)
        assert_masks_match(masks[b].numpy(), logits[b].numpy(), ref[3], (70, 90))



def test_module_resizing_inside_matches_mmdet_predict_in_pytorch(model):
    """The graph's module resizing inside (to 96 x 96, as RFDETRResize) on a 75 x 117 image vs
    mmdet's predict on RFDETRResize's pixels, rescaled: boxes and masks at the image's size."""
    side = 96
    module = EndToEndDetector(model, (side, side)).eval()
    image = _images(6, [(75, 117)])[0]
    with torch.no_grad():
        boxes, scores, labels, num, masks, logits = module(image[None])
    assert masks.shape == (1, MAX_PER_IMG, 75, 117)
    assert logits.shape == (1, MAX_PER_IMG, side // 4, side // 4)
    ref = mmdet_instances(model, image, (side, side))
    assert_detections_match(boxes[0].numpy(), scores[0].numpy(), labels[0].numpy(), ref, 1e-4)
    assert_masks_match(masks[0].numpy(), logits[0].numpy(), ref[3], (side, side), (75, 117))


def test_a_resize_outside_the_graph_is_refused(model, tmp_path):
    """RF-DETR-Seg's masks come out of the graph at the image's size: a test pipeline that
    resizes outside it (mmdet's Resize, the base config's) is refused at export, naming the fix."""
    base = tmp_path / 'tiny_rfdetr.py'
    base.write_text(CONFIG)
    cfg = Config.fromfile(str(base))
    with pytest.raises(ValueError) as refused:
        pipeline_meta(cfg, EndToEndDetector(model))
    assert str(refused.value) == (
        "test pipeline {'type': 'Resize', 'scale': (192, 192), 'keep_ratio': True}: RF-DETR-Seg "
        "resizes inside the graph (its masks come out at the image's size): resize with "
        "RFDETRResize(scale=..., keep_ratio=False), as rfdetr's predict and "
        "configs/rfdetr/rfdetr_seg_*.py do")


@pytest.fixture(scope='module')
def exported(config, model, tmp_path_factory):
    """Exported through the tool, which checks onnxruntime against predict (mask IoU too)."""
    return export_through_tool(config, model, tmp_path_factory.mktemp('rfdetr_seg'),
                               'rfdetr_seg')


@pytest.mark.slow
def test_graph_matches_mmdet_predict(model, exported):
    """onnxruntime on images of three sizes (resized to the network's inside) vs predict with
    RFDETRResize's pixels, rescaled: boxes and masks at each image's size."""
    session = ort_session(exported[1])
    assert [o.name for o in session.get_outputs()] == [*OUTPUT_NAMES, *SEG_MASK_OUTPUTS]
    for image in _images(0, SIZES):
        size = tuple(image.shape[-2:])
        boxes, scores, labels, num, masks, logits = session.run(None, {'image': image[None]
                                                                       .numpy()})
        ref = mmdet_instances(model, image, NETWORK_SIZE)
        assert int(num[0]) == MAX_PER_IMG and masks.shape[-2:] == size
        assert_detections_match(boxes[0], scores[0], labels[0], ref, BOX_TOLERANCE * max(size))
        assert_masks_match(masks[0], logits[0], ref[3], NETWORK_SIZE, size)


@pytest.mark.slow
def test_runner_and_infer_masks_equal_mmdet(config, model, exported, tmp_path):
    """The runner on a 300 x 384 image (given to the graph as it is, resized inside to the
    network's 128 x 96) vs predict with rescale; then tools/infer.py's masks, onnxruntime
    backend vs PyTorch backend (mmdet's DetInferencer)."""
    ckpt, path = exported
    original = np.random.default_rng(1).integers(0, 256, (300, 384, 3), dtype=np.uint8)
    runner = OnnxDetector(path)
    got = runner(original)
    batch, scale = runner.preprocess(original)
    assert batch.shape == (1, 3, 300, 384) and scale == (1.0, 1.0)
    logits = runner.session.run(None, {'image': batch})[5][0]
    ref = mmdet_instances(model, torch.from_numpy(batch[0]), NETWORK_SIZE)
    assert_detections_match(got.boxes, got.scores, got.labels, ref, BOX_TOLERANCE * 384)
    assert got.masks.shape == (MAX_PER_IMG, 300, 384)
    assert_masks_match(got.masks, logits, ref[3], NETWORK_SIZE, (300, 384))

    folder = tmp_path / 'images'
    folder.mkdir()
    cv2.imwrite(str(folder / '0.png'), original)
    tool = load_tool('infer.py')
    assert tool.main([str(folder), '--out-dir', str(tmp_path / 'ort'), '--backend',
                      'onnxruntime', '--onnx', path, '--no-draw']) == 0
    assert tool.main([str(folder), '--out-dir', str(tmp_path / 'pt'), '--backend', 'pytorch',
                      '--config', config, '--checkpoint', ckpt, '--no-draw']) == 0
    from pycocotools import mask as mask_utils
    ort, pt = (json.loads((tmp_path / d / 'predictions.json').read_text()) for d in ('ort', 'pt'))
    a, b = (np.stack([mask_utils.decode(d['segmentation']) for d in x['annotations']])
            for x in (ort, pt))
    assert a.shape == b.shape == (MAX_PER_IMG, 300, 384)
    assert_masks_match(a, logits, b, NETWORK_SIZE, (300, 384))
