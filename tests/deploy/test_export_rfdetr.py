"""End-to-end ONNX export of RF-DETR (the head's own test path traced): a tiny mmdet
``SingleStageDetector`` (DINOv2 taps -> ``RFDETRProjector`` -> ``LWDETRHead``, seeded random
weights) as a uint8 image -> detections graph: the graph's module in PyTorch vs mmdet's
``predict`` on a padded batch (default suite); exported through ``tools/export_onnx.py --part
detector`` (slow: the export alone takes about 30 s of CPU): onnxruntime vs mmdet's ``predict``
at three sizes and at one with fewer tokens than queries, a batch equal to its single images,
the runner and ``tools/infer.py`` vs the PyTorch backend, a change of the head's forward seen in
the graph; the refusals."""
import json
import os.path as osp

import cv2
import numpy as np
import pytest
import torch
from helpers import REPO_ROOT, load_tool, randomize_
from mmengine.config import Config

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import (OUTPUT_NAMES, PAD_LABEL, EndToEndDetector,
                                             check_exportable, export_end_to_end,
                                             graph_resize)
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, PROPOSAL_OUTPUT,
                                                   SCORE_TOLERANCE, Parity, compare, describe,
                                                   mmdet_predict, proposal_gap,
                                                   threshold_session, untied)
from vitdet_plugin.deploy.onnx_export import DetectorPart, build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.runner import OnnxDetector

#: The shapes demo's data and pipelines (5 classes, test Resize to 192 keeping the ratio) with a
#: tiny RF-DETR: a 2-block DINOv2 (patch 16, 4 registers, a 7 x 7 position table resized to
#: every input, RF-DETR's 2 x 2 windows: block 0 within its tile, block 1 global) tapped after
#: both, the projector's P4 and P5 (two levels: deformable attention and proposals over both),
#: 12 queries, 3 groups in training, 2 decoder layers.
CONFIG = f"""
_base_ = '{osp.join(REPO_ROOT, 'configs', 'demo', 'swin_detr_shapes.py')}'
model = dict(
    _delete_=True,
    type='SingleStageDetector',
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                           std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_size_divisor=32),
    backbone=dict(type='DINOv2Backbone',
                  arch=dict(embed_dims=32, depth=2, num_heads=2, num_reg_tokens=4),
                  patch_size=16, out_indices=(0, 1), pretrain_img_size=112,
                  pretrain_patch_size=16, num_windows=2),
    neck=dict(type='RFDETRProjector', in_channels=[32, 32], out_channels=32,
              levels=('P4', 'P5'), num_blocks=1),
    bbox_head=dict(type='LWDETRHead', num_classes=5, embed_dims=32, num_levels=2,
                   num_queries=12, num_groups=3, num_decoder_layers=2, self_heads=2,
                   cross_heads=4, ffn_dims=64),
    test_cfg=dict(max_per_img=10))
"""
#: Check images: one a multiple of the pad divisor (32), two not (padded tokens masked).
SIZES = ((96, 128), (75, 117), (130, 99))
#: An input whose maps hold fewer tokens than the 12 queries: padded to 32 x 64, P4 2 x 4 and
#: P5 1 x 2, 10 tokens (10 proposals; the other 2 queries keep their learned boxes).
FEW_TOKENS = (20, 40)
#: randomize_'s seed (spread-out scores and boxes; several labels among the detections).
WEIGHT_SEED = 3
MAX_PER_IMG = 10


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp('rfdetr_cfg') / 'tiny_rfdetr.py'
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture(scope='module')
def model(config):
    return randomize_(build_model(config)[1], seed=WEIGHT_SEED).eval()


def _images(seed: int = 0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def check_module_matches_predict(model, kind: str, max_per_img: int) -> list:
    """The graph's module (``kind``) before export on a padded batch of two (70 x 90 -> 96 x 96)
    vs mmdet's predict per image (each full: ``max_per_img`` detections); mmdet's labels."""
    module = EndToEndDetector(model).eval()
    assert module.kind == kind
    images = _images(2, [(70, 90), (70, 90)])
    with torch.no_grad():
        boxes, scores, labels, num = module(torch.stack(images))
    predicted = []
    for b, image in enumerate(images):
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
        assert int(num[b]) == len(ref_scores) == max_per_img
        np.testing.assert_allclose(scores[b].numpy(), ref_scores, atol=1e-6, rtol=0)
        ranks = untied(ref_scores)
        np.testing.assert_allclose(boxes[b].numpy()[ranks], ref_boxes[ranks], atol=1e-4, rtol=0)
        assert np.array_equal(labels[b].numpy()[ranks], ref_labels[ranks])
        predicted.append(ref_labels)
    return predicted


def test_module_matches_mmdet_predict_in_pytorch(model):
    for labels in check_module_matches_predict(model, 'lwdetr', MAX_PER_IMG):
        assert len(set(labels.tolist())) > 1


def test_proposals_that_differ_only_between_near_tied_tokens_are_not_a_failure():
    """The export check's reading of the graph's proposal tokens: the same tokens in the same
    order say nothing; tokens swapped whose PyTorch scores are within the tie tolerance make
    the size not comparable (passed, said so); any other difference fails."""
    gap = 2.0 ** -21  # 2 float32 steps at 2.0
    scores = torch.tensor([0.0, 3.0, 2.0, 2.0 + gap, -1.0, 1.0])  # tokens 2 and 3 near-tied
    assert proposal_gap(np.array([1, 3, 2]), scores) is None       # PyTorch's own top 3
    swapped = proposal_gap(np.array([1, 2, 3]), scores)
    assert swapped == gap
    assert proposal_gap(np.array([1, 3, 5]), scores) == 1.0
    base = dict(size=(96, 128), num_onnx=5, num_torch=5, box_error=0.5, score_error=0.5,
                labels_equal=False)  # outputs far apart: after a swap, queries differ
    tied = Parity(**base, proposal_gap=swapped)
    assert tied.ok and tied.tied
    assert describe(tied, False, False) == (
        "the two-stage proposals differ from PyTorch's between tokens whose PyTorch scores are "
        "4.8e-07 apart: near-tied (<= 1e-05), onnxruntime's rounding may rank them the other "
        'way; outputs not comparable at this size, ok')
    wrong = Parity(**dict(base, box_error=0.0, score_error=0.0, labels_equal=True),
                   proposal_gap=1.0)
    assert not wrong.ok and describe(wrong, False, False).endswith('1.0e+00 apart: not a tie '
                                                                  'FAILED')
    assert not Parity(**base).ok


def test_what_the_graph_does_not_repeat_is_refused(model):
    class NoExtractFeat:
        bbox_head = model.bbox_head

    with pytest.raises(ValueError, match=r'^NoExtractFeat with LWDETRHead: no end-to-end export '
                                         r'\(supported: a single-stage detector, extract_feat -> '
                                         r'bbox_head\)$'):
        check_exportable(NoExtractFeat())


def test_fewer_tokens_than_queries_in_pytorch(model):
    """10 tokens for 12 queries: the graph's module equals mmdet's predict (10 proposals, the
    other 2 queries on their learned boxes, RF-DETR's rule)."""
    image = _images(0, [FEW_TOKENS])[0]
    with torch.no_grad():
        boxes, scores, labels, num = EndToEndDetector(model).eval()(image[None])
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
    assert int(num[0]) == len(ref_scores) == MAX_PER_IMG
    np.testing.assert_allclose(scores[0].numpy(), ref_scores, atol=1e-6, rtol=0)
    np.testing.assert_allclose(boxes[0].numpy(), ref_boxes, atol=1e-4, rtol=0)


def export_through_tool(config: str, model, folder, name: str):
    """``model``'s weights saved as ``folder/name.pth`` and exported through the tool to
    ``folder/name.onnx``; the tool checks onnxruntime against mmdet's predict at one size."""
    ckpt, path = str(folder / f'{name}.pth'), str(folder / f'{name}.onnx')
    torch.save({'state_dict': model.state_dict(),
                'meta': {'dataset_meta': {'classes': ['a', 'b', 'c', 'd', 'e']}}}, ckpt)
    assert load_tool('export_onnx.py').main([config, ckpt, '--out', path, '--part', 'detector',
                                             '--check-sizes', '57x91']) == 0
    return ckpt, path


@pytest.fixture(scope='module')
def exported(config, model, tmp_path_factory):
    """The random weights exported through the tool (the tests below check three more sizes)."""
    return export_through_tool(config, model, tmp_path_factory.mktemp('rfdetr'), 'rfdetr')


@pytest.mark.slow
def test_graph_matches_mmdet_predict(model, exported):
    session = ort_session(exported[1])
    assert [o.name for o in session.get_outputs()] == list(OUTPUT_NAMES)
    assert [isinstance(d, str) for d in session.get_inputs()[0].shape] == [True, False, True,
                                                                         True]
    # the check's session also outputs the graph's proposal tokens: PyTorch's top-k exactly
    checked, _ = threshold_session(exported[1], proposals=True)
    assert [o.name for o in checked.get_outputs()] == [*OUTPUT_NAMES, PROPOSAL_OUTPUT]
    for p in compare(checked, model, _images() + _images(0, [FEW_TOKENS])):
        assert p.proposal_gap is None, p
        assert p.num_onnx == p.num_torch == MAX_PER_IMG, p
        assert p.box_error <= BOX_TOLERANCE and p.score_error <= SCORE_TOLERANCE, p
        assert p.labels_equal, p


@pytest.mark.slow
def test_batch_rows_are_the_single_images(exported):
    session = ort_session(exported[1])
    images = torch.stack(_images(1, [(83, 101)] * 3)).numpy()   # a batch of 3 (exported at 2)
    boxes, scores, labels, num = session.run(None, {'image': images})
    assert boxes.shape == (3, MAX_PER_IMG, 4) and labels.dtype == num.dtype == np.int64
    for b in range(3):
        one = session.run(None, {'image': images[b:b + 1]})
        np.testing.assert_allclose(boxes[b], one[0][0], atol=BOX_TOLERANCE * 101, rtol=0)
        np.testing.assert_allclose(scores[b], one[1][0], atol=SCORE_TOLERANCE, rtol=0)
        assert np.array_equal(labels[b], one[2][0]) and int(num[b]) == MAX_PER_IMG
        assert np.all(np.diff(scores[b]) <= 0) and np.all(labels[b] != PAD_LABEL)


@pytest.mark.slow
def test_runner_and_infer_equal_mmdet(config, model, exported, tmp_path):
    """The runner on an image the test pipeline keeps (192 x 150) vs mmdet's predict; then
    tools/infer.py, onnxruntime backend vs PyTorch backend (mmdet's DetInferencer), on files
    the pipeline resizes (300 x 384 -> 150 x 192) and keeps."""
    ckpt, path = exported
    image = _images(4, [(150, 192)])[0]
    got = OnnxDetector(path)(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
    ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
    np.testing.assert_allclose(got.scores, ref_scores, atol=SCORE_TOLERANCE, rtol=0)
    ranks = untied(ref_scores)
    np.testing.assert_allclose(got.boxes[ranks], ref_boxes[ranks], atol=BOX_TOLERANCE * 192,
                               rtol=0)
    assert np.array_equal(got.labels[ranks], ref_labels[ranks])
    runner = OnnxDetector(path)
    runner.meta['resize'] = None   # (the test pipeline would resize it up to 96 x 192)
    small = _images(6, [FEW_TOKENS])[0]  # 10 tokens for 12 queries, as PyTorch
    got = runner(np.ascontiguousarray(small.permute(1, 2, 0).numpy()))
    np.testing.assert_allclose(got.scores, mmdet_predict(model, small)[1],
                               atol=SCORE_TOLERANCE, rtol=0)

    folder = tmp_path / 'images'
    folder.mkdir()
    g = np.random.default_rng(0)
    for i, (h, w) in enumerate([(300, 384), (150, 192)]):
        cv2.imwrite(str(folder / f'{i}.png'), g.integers(0, 256, (h, w, 3), dtype=np.uint8))
    tool = load_tool('infer.py')
    assert tool.main([str(folder), '--out-dir', str(tmp_path / 'ort'), '--backend',
                      'onnxruntime', '--onnx', path, '--no-draw']) == 0
    assert tool.main([str(folder), '--out-dir', str(tmp_path / 'pt'), '--backend', 'pytorch',
                      '--config', config, '--checkpoint', ckpt, '--no-draw']) == 0
    ort, pt = (json.loads((tmp_path / d / 'predictions.json').read_text()) for d in ('ort', 'pt'))
    assert ort['images'] == pt['images']
    for image_info in ort['images']:
        a, b = ([d for d in x['annotations'] if d['image_id'] == image_info['id']]
                for x in (ort, pt))
        assert len(a) == len(b) == MAX_PER_IMG
        scores_b = np.array([d['score'] for d in b])
        np.testing.assert_allclose([d['score'] for d in a], scores_b, atol=SCORE_TOLERANCE,
                                   rtol=0)
        ranks = untied(scores_b)
        side = max(image_info['width'], image_info['height'])
        np.testing.assert_allclose(np.array([d['bbox'] for d in a])[ranks],
                                   np.array([d['bbox'] for d in b])[ranks],
                                   atol=BOX_TOLERANCE * side, rtol=0)


#: A test pipeline resizing as RF-DETR's predict (RFDETRResize to a square, keep_ratio=False):
#: the graph takes the image as it is and resizes inside.
IN_GRAPH_SIDE = 96
IN_GRAPH_PIPELINE = f"""
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RFDETRResize', scale=({IN_GRAPH_SIDE}, {IN_GRAPH_SIDE}), keep_ratio=False),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                          'scale_factor')),
]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
"""


def test_graph_resize_follows_the_test_pipeline(config, tmp_path):
    """RFDETRResize to a fixed square resizes inside the graph; mmdet's Resize (the shapes
    demo's, keeping the ratio) does not; the shipped RF-DETR configs resize inside."""
    assert graph_resize(Config.fromfile(config)) is None
    path = tmp_path / 'in_graph.py'
    path.write_text(CONFIG + IN_GRAPH_PIPELINE)
    assert graph_resize(Config.fromfile(str(path))) == (IN_GRAPH_SIDE, IN_GRAPH_SIDE)
    nano = Config.fromfile(osp.join(REPO_ROOT, 'configs', 'rfdetr', 'rfdetr_nano.py'))
    assert graph_resize(nano) == (384, 384)


def test_module_resizing_inside_matches_mmdet_predict_through_rfdetr_resize(model):
    """The graph's module resizing inside (to 96 x 96) on images of two other sizes vs mmdet's
    predict on RFDETRResize's pixels, rescaled to the image (boxes in its pixels)."""
    module = EndToEndDetector(model, (IN_GRAPH_SIDE, IN_GRAPH_SIDE)).eval()
    for image in _images(7, [(75, 117), (130, 99)]):
        with torch.no_grad():
            boxes, scores, labels, num = module(image[None])
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image,
                                                          (IN_GRAPH_SIDE, IN_GRAPH_SIDE))
        assert int(num[0]) == len(ref_scores) == MAX_PER_IMG
        np.testing.assert_allclose(scores[0].numpy(), ref_scores, atol=1e-6, rtol=0)
        ranks = untied(ref_scores)
        np.testing.assert_allclose(boxes[0].numpy()[ranks], ref_boxes[ranks], atol=1e-4, rtol=0)
        assert np.array_equal(labels[0].numpy()[ranks], ref_labels[ranks])
        # the boxes are in the image's pixels: some reach past the 96 px of the network's
        assert boxes[0, :, 2].max() > IN_GRAPH_SIDE or boxes[0, :, 3].max() > IN_GRAPH_SIDE


@pytest.mark.slow
def test_infer_onnxruntime_resizing_inside_equals_mmdet_inference(model, tmp_path):
    """Exported through the tool with the RFDETRResize pipeline: the graph takes a 480 x 640
    file as it is (no OpenCV resize in the runner) and tools/infer.py's onnxruntime backend
    equals mmdet's ``inference_detector`` (the config's test pipeline) on it."""
    from mmdet.apis import inference_detector, init_detector

    config = tmp_path / 'in_graph.py'
    config.write_text(CONFIG + IN_GRAPH_PIPELINE)
    ckpt, path = export_through_tool(str(config), model, tmp_path, 'in_graph')
    meta = OnnxDetector(path).meta
    assert meta['resize'] == dict(scale=[IN_GRAPH_SIDE, IN_GRAPH_SIDE], keep_ratio=False,
                                  in_graph=True)
    folder = tmp_path / 'images'
    folder.mkdir()
    image = np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    cv2.imwrite(str(folder / 'a.png'), image)
    assert load_tool('infer.py').main([str(folder), '--out-dir', str(tmp_path / 'ort'),
                                       '--backend', 'onnxruntime', '--onnx', path,
                                       '--no-draw']) == 0
    found = json.loads((tmp_path / 'ort' / 'predictions.json').read_text())['annotations']
    detector = init_detector(str(config), ckpt, device='cpu')
    ref = inference_detector(detector, str(folder / 'a.png')).pred_instances
    order = torch.argsort(ref.scores, descending=True, stable=True)
    ref_scores, ref_boxes = ref.scores[order].numpy(), ref.bboxes[order].numpy()
    assert len(found) == len(ref_scores) == MAX_PER_IMG
    np.testing.assert_allclose([d['score'] for d in found], ref_scores, atol=SCORE_TOLERANCE,
                               rtol=0)
    ranks = untied(ref_scores)
    xywh = np.array([d['bbox'] for d in found])
    xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1)
    np.testing.assert_allclose(xyxy[ranks], ref_boxes[ranks], atol=BOX_TOLERANCE * 640, rtol=0)
    assert np.array_equal(np.array([d['category_id'] for d in found])[ranks],
                          ref.labels[order].numpy()[ranks])


@pytest.mark.slow
def test_a_change_of_the_heads_forward_reaches_the_graph(model, tmp_path, monkeypatch):
    """The graph is the head's own forward: with its last decoder layer's FFN output doubled
    (a monkeypatched forward) the exported graph gives the patched model's detections, not
    the original's."""
    image = _images(5, [(96, 128)])[0][None]
    module = EndToEndDetector(model).eval()
    with torch.no_grad():
        before = module(image)
    ffn = model.bbox_head.decoder.layers[-1].ffn
    original = ffn.forward
    monkeypatch.setattr(ffn, 'forward', lambda x: 2 * original(x))
    with torch.no_grad():
        after = module(image)
    assert (after[1] - before[1]).abs().max() > 100 * SCORE_TOLERANCE
    path = str(tmp_path / 'patched.onnx')
    export_end_to_end(module, path)
    boxes, scores = ort_session(path).run(None, {'image': image.numpy()})[:2]
    np.testing.assert_allclose(scores, after[1].numpy(), atol=SCORE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(boxes, after[0].numpy(), atol=BOX_TOLERANCE * 128, rtol=0)


def test_a_windowed_part_fits_sizes_to_its_tiles(model):
    """The windowed DINOv2 (patch 16, 2 x 2 windows: the patch grid's sides must be even)
    names the smallest size it takes at least as large as a given one: the export's sample
    233x311 (a 15 x 20 grid) -> 241x311, 57x91 (4 x 6) kept, 45x91 (3 x 6, refused) ->
    49x91; a backbone that pads inside keeps every size."""
    part = DetectorPart(model, 'neck')
    assert part.fit_size((233, 311)) == (241, 311)
    assert part.fit_size((57, 91)) == (57, 91) and part.fit_size((45, 91)) == (49, 91)
    with torch.no_grad():
        assert part(torch.zeros(1, 3, 49, 91))[0].shape == (1, 32, 4, 6)
        with pytest.raises(ValueError, match=r'nearest valid sizes are 32x64 and 64x96'):
            part(torch.zeros(1, 3, 45, 91))
    plain = DetectorPart(type(model.backbone)(
        arch=dict(embed_dims=32, depth=1, num_heads=2), patch_size=16, out_indices=(0,)),
        'backbone')
    assert plain.fit_size((45, 91)) == (45, 91)


@pytest.mark.slow
def test_part_export_of_a_windowed_backbone_traces_and_checks_at_sizes_it_takes(config, tmp_path,
                                                                              capsys):
    """``--part neck`` of the windowed DINOv2 through the tool: traced at the sample size
    fitted to the tiles, a check size the backbone takes kept, one it does not moved (above),
    saying so."""
    out = str(tmp_path / 'neck.onnx')
    assert load_tool('export_onnx.py').main([config, '--out', out, '--part', 'neck',
                                             '--check-sizes', '57x91', '45x91',
                                             '--repeats', '0']) == 0
    printed = capsys.readouterr().out
    assert ('check size 45x91 -> 49x91: the smallest size the backbone takes (the detector pads '
            'its images to such sizes)') in printed
    assert 'check size 57x91' not in printed
    for size in ('57x91', '49x91'):
        assert f'{size} batch 1: max rel. error' in printed
    assert printed.count('ok; shapes') == 2
