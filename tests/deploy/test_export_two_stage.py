"""End-to-end ONNX export of Mask R-CNN (``vitdet_plugin/deploy/two_stage.py``) and Panoptic FPN
(the same Mask R-CNN plus a semantic head, ``deploy/panoptic.py``): onnxruntime vs mmdet's own
``predict`` (boxes, scores, labels, pasted masks and the panoptic map) on the shrunk
``make demo-seg`` config with random weights, a batch equal to its single images, the runner
mapping masks and panoptic maps back to the original image (``tools/infer.py`` with torch and
mmdet blocked vs mmdet's DetInferencer; COCO panoptic PNGs, PQ and mIoU) and the refusal of RoI
heads the graph does not repeat.

One export serves both detectors: the Panoptic FPN demo's Mask R-CNN is
``configs/demo/swin_mask_rcnn_shapes.py``'s model (the same ``_base_`` model file), and its graph
is the Mask R-CNN graph plus the ``sem_logits`` output (an export takes about a minute of CPU)."""
import json
import os.path as osp
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import REPO_ROOT, load_tool, randomize_, subprocess_env
from mmengine.config import Config
from pycocotools import mask as mask_utils
from test_export_detector import BLOCKED_RUN, _config_text, _write_images

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import (OUTPUT_NAMES, PAD_LABEL, EndToEndDetector,
                                             add_metadata, check_exportable,
                                             export_end_to_end, fusion_meta, pipeline_meta)
from vitdet_plugin.deploy.graph_ops import NmsConfig
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, MASK_IOU_TOLERANCE,
                                                   PANOPTIC_TOLERANCE, SCORE_TOLERANCE, compare,
                                                   mask_iou, mmdet_instances, mmdet_predict,
                                                   untied)
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.panoptic import INSTANCE_OFFSET, SEMANTIC_OUTPUT
from vitdet_plugin.deploy.runner import MASK_OUTPUTS, OnnxDetector, paste_mask

#: The shrunk demo Mask R-CNN (stem Swin + GN FPN P3-P6, RPN, 2-FC box head, FCN mask head).
MASK_RCNN_CONFIG = 'configs/demo/swin_mask_rcnn_shapes.py'
OPTIONS = {'model.backbone.depths': [1, 1, 1], 'model.roi_head.bbox_head.fc_out_channels': 32,
           'model.roi_head.mask_head.num_convs': 1}
#: The exported one: that Mask R-CNN plus the semantic head (``make demo-seg``), with a low
#: instance threshold so random-weight detections enter the fusion.
CONFIG = 'configs/demo/swin_panoptic_fpn_shapes.py'
PANOPTIC_OPTIONS = dict(OPTIONS, **{'model.test_cfg.panoptic.instance_score_thr': 0.05,
                                    'model.test_cfg.panoptic.stuff_area_limit': 200})
#: Scale of the semantic head's classifier after perturb_ (spread-out logits, few ties).
SEMANTIC_SCALE = 4.0
#: Thing and stuff labels of the shapes panoptic data (5 shapes; lines, background).
NUM_THINGS, NUM_CLASSES = 5, 7
#: Check images: one multiple of the pad divisor (32), two that are not (padding inside).
SIZES = ((96, 128), (75, 117), (130, 99))
#: Weight scales after randomize_ that spread the scores (random weights give near-ties).
SCALES = {'rpn_head.rpn_cls': 3.0, 'roi_head.bbox_head.shared_fcs.1': 3.0,
          'roi_head.bbox_head.fc_cls': 5.0, 'roi_head.mask_head.conv_logits': 5.0}
#: Bright rectangles drawn on each check image (objects for the RPN), their side range in px.
RECTANGLES, SIDES = 4, (12, 40)


def perturb_(model: torch.nn.Module) -> None:
    """Random weights with detections of spread-out scores, two labels and non-empty masks."""
    randomize_(model, seed=2)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for m in model.modules():  # randomize_ gives 'gn.weight' ~0.05: the FPN would
            if isinstance(m, torch.nn.GroupNorm):  # output its biases only
                m.weight.add_(1.0)
        for name, scale in SCALES.items():
            if name in modules:  # (Faster R-CNN: no mask head)
                modules[name].weight.mul_(scale)
        cls = modules['roi_head.bbox_head.fc_cls']
        cls.weight.sub_(cls.weight.mean(1, keepdim=True))  # not one class for every RoI
        cls.bias.zero_()


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    cfg, model = build_model(osp.join(REPO_ROOT, CONFIG), cfg_options=dict(PANOPTIC_OPTIONS))
    perturb_(model)
    with torch.no_grad():
        model.semantic_head.conv_logits.weight.mul_(SEMANTIC_SCALE)
    module = EndToEndDetector(model)
    path = str(tmp_path_factory.mktemp('mask_rcnn') / 'model.onnx')
    export_end_to_end(module, path)
    add_metadata(path, pipeline_meta(cfg, module))
    return model, module, path


def _images(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = []
    for h, w in SIZES:
        image = torch.randint(0, 64, (3, h, w), dtype=torch.uint8, generator=g)
        for _ in range(RECTANGLES):
            y = int(torch.randint(0, h - SIDES[0], (1,), generator=g))
            x = int(torch.randint(0, w - SIDES[0], (1,), generator=g))
            sh, sw = torch.randint(*SIDES, (2,), generator=g).tolist()
            image[:, y:y + sh, x:x + sw] = torch.randint(100, 256, (3, 1, 1), dtype=torch.uint8,
                                                         generator=g)
        images.append(image)
    return images


def test_graph_matches_mmdet_predict_with_masks_and_panoptic_map(exported):
    """Instances with masks, and the panoptic map of the runner's fusion, equal mmdet's predict
    at three sizes (two with padding inside the graph)."""
    model, module, path = exported
    assert module.kind == 'two_stage' and module.panoptic
    session = ort_session(path)
    assert [o.name for o in session.get_outputs()] == \
        list(OUTPUT_NAMES) + list(MASK_OUTPUTS) + [SEMANTIC_OUTPUT]
    labels_seen = set()
    things = stuff = 0
    for p, image in zip(compare(session, model, _images()), _images()):
        assert p.num_onnx == p.num_torch > 0, p
        assert p.box_error <= BOX_TOLERANCE and p.score_error <= SCORE_TOLERANCE, p
        assert p.labels_equal and p.mask_iou >= MASK_IOU_TOLERANCE, p
        assert p.panoptic_agreement >= PANOPTIC_TOLERANCE, p
        _, _, labels, num, masks, probs, sem = session.run(None, {'image': image[None].numpy()})
        assert masks.dtype == np.uint8 and masks.shape == (1, module.max_per_img, *p.size)
        assert probs.dtype == np.float32 and probs.shape == (1, module.max_per_img, 28, 28)
        assert set(np.unique(masks)) <= {0, 1} and masks[0, :int(num[0])].any()
        padded = [-(-side // module.pad_divisor) * module.pad_divisor for side in p.size]
        assert sem.shape == (1, 3, *(side // 8 for side in padded))  # stuff + 1, stride 8
        labels_seen |= set(labels[0, :int(num[0])].tolist())
        panoptic = mmdet_instances(model, image)[4]
        things += int((panoptic >= INSTANCE_OFFSET).any())
        stuff += int(((panoptic >= NUM_THINGS) & (panoptic < NUM_CLASSES)).any())
    assert len(labels_seen) > 1  # the class-specific decode and class-aware NMS see classes
    assert things and stuff  # the panoptic maps compared hold instances and stuff


def test_batch_rows_are_the_single_images(exported):
    _, module, path = exported
    session = ort_session(path)
    images = torch.stack([_images(1)[1], _images(2)[1]]).numpy()   # two 75 x 117 images
    boxes, scores, labels, num, masks, probs, sem = session.run(None, {'image': images})
    k = module.max_per_img
    assert boxes.shape == (2, k, 4) and masks.shape == (2, k, 75, 117)
    for b in range(2):
        one = session.run(None, {'image': images[b:b + 1]})
        n = int(num[b])
        assert n == int(one[3][0]) > 0
        np.testing.assert_allclose(boxes[b], one[0][0], atol=1e-3)
        np.testing.assert_allclose(scores[b], one[1][0], atol=SCORE_TOLERANCE)
        assert np.array_equal(labels[b], one[2][0])
        assert mask_iou(masks[b, :n], one[4][0, :n]).min() >= MASK_IOU_TOLERANCE
        np.testing.assert_allclose(probs[b], one[5][0], atol=SCORE_TOLERANCE)
        np.testing.assert_allclose(sem[b], one[6][0], atol=SCORE_TOLERANCE)
        assert np.all(labels[b, n:] == PAD_LABEL) and not masks[b, n:].any()
        assert not probs[b, n:].any()


#: Pixels of tools/infer.py's panoptic PNGs equal between the backends. Lower than the export
#: check's PANOPTIC_TOLERANCE: the PNGs hold every discrete decision of the whole pipeline (score
#: threshold, overlap, stuff area) on a random-init model, where one instance flipping under a
#: 1e-7 difference (SDPA in PyTorch, the explicit formula in the graph) recolours its pixels:
#: 98.96 % on one of the 3 images (measured 2026-12-02), PQ and mIoU equal within 0.5.
INFER_PANOPTIC_TOLERANCE = 0.98


def test_infer_writes_panoptic_maps_and_pq_like_the_pytorch_backend(exported, tmp_path, capsys):
    """tools/infer.py on shapes val images (256 px, resized to 192 by the test pipeline, so the
    runner resizes the semantic logits and pastes the masks at the original size): the
    onnxruntime backend's COCO panoptic PNGs equal mmdet's DetInferencer's (pytorch backend),
    and so do PQ and mIoU against the data's panoptic ground truth."""
    model, _, path = exported
    data = tmp_path / 'shapes'
    load_tool('make_shapes.py').main(['--out', str(data), '--num-train', '1', '--num-val', '3',
                                      '--quiet'])
    ann = str(data / 'annotations' / 'panoptic_val.json')
    ckpt = tmp_path / 'model.pth'
    torch.save({'state_dict': model.state_dict(),
                'meta': {'dataset_meta': {'classes': OnnxDetector(path).classes}}}, ckpt)
    cfg_path = tmp_path / 'tiny.py'
    cfg_path.write_text(_config_text(CONFIG, PANOPTIC_OPTIONS))
    infer = load_tool('infer.py')
    scores = {}
    for backend, args in (('onnxruntime', ['--onnx', path]),
                          ('pytorch', ['--config', str(cfg_path), '--checkpoint', str(ckpt)])):
        assert infer.main([str(data / 'val'), '--out-dir', str(tmp_path / backend), '--backend',
                           backend, *args, '--no-draw', '--panoptic-ann-file', ann]) == 0
        out = capsys.readouterr().out
        scores[backend] = [float(v) for v in re.findall(r'(?:PQ|mIoU) (\d+\.\d+)', out)]
    assert len(scores['onnxruntime']) == 2
    np.testing.assert_allclose(scores['onnxruntime'], scores['pytorch'], atol=0.5)
    import cv2
    for name in ('000000.png', '000001.png', '000002.png'):
        ours, ref = (cv2.imread(str(tmp_path / b / 'panoptic' / name))
                     for b in ('onnxruntime', 'pytorch'))
        assert ours.shape == ref.shape == (256, 256, 3)
        assert (ours == ref).all(-1).mean() >= INFER_PANOPTIC_TOLERANCE


#: Boxes of the paste tests: inside, the whole image, partly outside, one without width.
PASTE_BOXES = [[10.3, 5.7, 60.2, 40.9], [0.0, 0.0, 137.0, 99.0], [-8.5, 20.1, 30.4, 120.6],
               [100.2, 80.5, 150.0, 110.0], [40.0, 30.0, 40.0, 50.0], [70.6, 2.2, 71.4, 9.9]]
PASTE_SIZE = (99, 137)


def _mmdet_paste(probs: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    from mmdet.models.roi_heads.mask_heads.fcn_mask_head import _do_paste_mask
    return _do_paste_mask(probs[:, None], boxes, *PASTE_SIZE, skip_empty=False)[0]


def test_runner_paste_is_mmdets_do_paste_mask():
    """The runner's numpy paste (mask probabilities at another image size) against mmdet's
    own _do_paste_mask + threshold."""
    probs = torch.rand(len(PASTE_BOXES), 28, 28, generator=torch.Generator().manual_seed(0))
    boxes = torch.tensor(PASTE_BOXES)
    ref = _mmdet_paste(probs, boxes)
    for p, box, expected in zip(probs.numpy(), boxes.numpy(), ref.numpy()):
        ours = paste_mask(p, box, PASTE_SIZE, 0.5)
        assert (ours != (expected >= 0.5)).sum() <= 1  # float32 vs float64 at the threshold
        assert ours.shape == PASTE_SIZE and ours.dtype == np.uint8


def test_graph_paste_is_mmdets_do_paste_mask():
    """The graph's separable paste (two matrix products per box) against mmdet's
    _do_paste_mask (grid_sample over every pixel), before the threshold."""
    from vitdet_plugin.deploy.two_stage import _bilinear_weights
    probs = torch.rand(len(PASTE_BOXES), 28, 28, generator=torch.Generator().manual_seed(1))
    x0, y0, x1, y1 = torch.tensor(PASTE_BOXES).unbind(-1)
    ours = (_bilinear_weights(PASTE_SIZE[0], y0, y1, 28) @ probs
            @ _bilinear_weights(PASTE_SIZE[1], x0, x1, 28).transpose(1, 2))
    torch.testing.assert_close(ours, _mmdet_paste(probs, torch.tensor(PASTE_BOXES)),
                               atol=1e-6, rtol=0)


@pytest.mark.slow  # ~5-10 s (DetInferencer, a subprocess) over the default suite's 60 s budget;
# the paste it adds is checked against mmdet's _do_paste_mask in the default suite
def test_infer_onnxruntime_masks_equal_pytorch_backend(exported, tmp_path):
    """tools/infer.py on a folder (one image the test pipeline resizes, where the runner pastes
    the graph's mask_probs at the original size): the onnxruntime backend without torch / mmdet
    writes the COCO RLE masks of mmdet's DetInferencer (IoU >= 0.99 each)."""
    model, _, path = exported
    folder = _write_images(tmp_path / 'images', sizes=((150, 210), (192, 192)))
    env = subprocess_env(no_site=False, PYTHONPATH=REPO_ROOT)
    infer = osp.join(REPO_ROOT, 'tools', 'infer.py')
    run = subprocess.run([sys.executable, '-c', BLOCKED_RUN, infer, str(folder), '--out-dir',
                          str(tmp_path / 'ort'), '--backend', 'onnxruntime', '--onnx', path],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ckpt = tmp_path / 'model.pth'
    torch.save({'state_dict': model.state_dict(),
                'meta': {'dataset_meta': {'classes': OnnxDetector(path).classes}}}, ckpt)
    cfg_path = tmp_path / 'tiny.py'
    cfg_path.write_text(_config_text(CONFIG, PANOPTIC_OPTIONS))
    assert load_tool('infer.py').main([str(folder), '--out-dir', str(tmp_path / 'pt'),
                                       '--backend', 'pytorch', '--config', str(cfg_path),
                                       '--checkpoint', str(ckpt), '--no-draw']) == 0
    ort = json.loads((tmp_path / 'ort' / 'predictions.json').read_text())
    pt = json.loads((tmp_path / 'pt' / 'predictions.json').read_text())
    for image in ort['images']:
        a = [d for d in ort['annotations'] if d['image_id'] == image['id']]
        b = [d for d in pt['annotations'] if d['image_id'] == image['id']]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x['segmentation']['size'] == [image['height'], image['width']]
            rles = [dict(d['segmentation'], counts=d['segmentation']['counts'].encode())
                    for d in (x, y)]
            iou = mask_utils.iou([rles[0]], [rles[1]], [False])[0, 0]
            assert iou >= MASK_IOU_TOLERANCE, (image, x['score'], iou)


def test_no_detections_compare_as_no_ranks():
    assert untied(np.zeros(0)).shape == (0,)  # compare() on an image without detections


def test_faster_rcnn_module_matches_mmdet_predict():
    """Without a mask head (Faster R-CNN) the graph's module has the four outputs of the other
    detectors and equals mmdet's predict (in PyTorch: the ops are those exported above)."""
    options = dict(OPTIONS, **{'model.type': 'FasterRCNN', 'model.roi_head.mask_head': None,
                               'model.roi_head.mask_roi_extractor': None})
    options.pop('model.roi_head.mask_head.num_convs')
    _, model = build_model(osp.join(REPO_ROOT, MASK_RCNN_CONFIG), cfg_options=options)
    perturb_(model)
    module = EndToEndDetector(model).eval()
    assert module.output_names == list(OUTPUT_NAMES)
    for image in _images():
        with torch.no_grad():
            boxes, scores, labels, num = module(image[None])
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
        n = int(num[0])
        assert n == len(ref_scores) > 0
        np.testing.assert_allclose(scores[0, :n].numpy(), ref_scores, atol=SCORE_TOLERANCE)
        ranks = untied(ref_scores)  # a tie may be ordered either way
        np.testing.assert_allclose(boxes[0, :n].numpy()[ranks], ref_boxes[ranks], atol=1e-4)
        assert np.array_equal(labels[0, :n].numpy()[ranks], ref_labels[ranks])


def test_class_agnostic_nms_matches_mmdet_predict():
    """mmdet's stock Panoptic FPN suppresses across classes in its box head
    (``nms.class_agnostic=True``): the module (in PyTorch, the ops exported above) equals
    mmdet's predict with it, and differs from the class-aware result."""
    options = dict(OPTIONS, **{'model.test_cfg.rcnn.nms.class_agnostic': True,
                               'model.test_cfg.rcnn.max_per_img': 100})  # other labels too
    _, model = build_model(osp.join(REPO_ROOT, MASK_RCNN_CONFIG), cfg_options=options)
    perturb_(model)
    module = EndToEndDetector(model).eval()
    assert module.nms.class_agnostic
    for image in _images():
        with torch.no_grad():
            boxes, scores, labels, num = module(image[None])[:4]
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
        n = int(num[0])
        assert n == len(ref_scores) > 0
        np.testing.assert_allclose(scores[0, :n].numpy(), ref_scores, atol=SCORE_TOLERANCE)
        ranks = untied(ref_scores)
        np.testing.assert_allclose(boxes[0, :n].numpy()[ranks], ref_boxes[ranks], atol=1e-4)
        assert np.array_equal(labels[0, :n].numpy()[ranks], ref_labels[ranks])
    model.roi_head.test_cfg.nms.class_agnostic = False
    aware = EndToEndDetector(model).eval()
    with torch.no_grad():  # the class-aware NMS keeps boxes of one place with other labels
        assert not torch.equal(aware(_images()[0][None])[2], module(_images()[0][None])[2])


def test_mmdets_stock_panoptic_fpn_config_is_read_as_it_is_written():
    """mmdet's own ``panoptic-fpn_r50_fpn_1x_coco.py`` (ResNet-50, random init): exported as a
    Panoptic FPN whose box head NMS crosses classes, every detection entering the fusion
    (mmdet's PanopticFPN has no separate instance threshold), the fusion settings of the file."""
    import mmdet
    stock = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', 'panoptic_fpn',
                     'panoptic-fpn_r50_fpn_1x_coco.py')
    cfg, model = build_model(stock, cfg_options={'model.backbone.init_cfg': None})
    module = EndToEndDetector(model)
    assert (module.kind, module.panoptic) == ('two_stage', True)
    assert module.nms == NmsConfig(iou_threshold=0.5, class_agnostic=True)
    assert module.output_names[-1] == SEMANTIC_OUTPUT
    assert fusion_meta(module) == dict(num_things=80, num_stuff=53, mask_overlap=0.5,
                                       stuff_area_limit=4096, instance_score_thr=0.0,
                                       pad_size_divisor=32)


def test_soft_nms_is_refused():
    options = dict(OPTIONS, **{'model.test_cfg.rcnn.nms.type': 'soft_nms'})
    _, model = build_model(osp.join(REPO_ROOT, MASK_RCNN_CONFIG), cfg_options=options)
    with pytest.raises(ValueError, match=r"^RoI head: test_cfg nms type 'soft_nms': no end-to-end "
                                         r"export \(ONNX NonMaxSuppression is hard NMS"):
        EndToEndDetector(model)


def test_roi_heads_the_graph_does_not_repeat_are_refused(capsys):
    _, model = build_model(osp.join(REPO_ROOT, MASK_RCNN_CONFIG), cfg_options=dict(OPTIONS))
    assert check_exportable(model) == 'two_stage'
    import mmdet
    from mmdet.registry import MODELS
    configs = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs')
    for config, head in (('_base_/models/cascade-mask-rcnn_r50_fpn', 'CascadeRoIHead'),
                         ('htc/htc-without-semantic_r50_fpn_1x_coco', 'HybridTaskCascadeRoIHead')):
        cfg = Config.fromfile(osp.join(configs, f'{config}.py'))
        model.roi_head = MODELS.build(cfg.model.roi_head)
        with pytest.raises(ValueError, match=rf'MaskRCNN: RoI head {head}: no end-to-end export '
                                             r'\(supported: RPNHead \+ StandardRoIHead with '
                                             r'SingleRoIExtractor \(RoIAlign, avg\)'):
            check_exportable(model)
    code = load_tool('export_onnx.py').main([
        osp.join(REPO_ROOT, MASK_RCNN_CONFIG), '--out', 'x.onnx', '--part', 'detector',
        '--cfg-options',
        'model.rpn_head.loss_cls.use_sigmoid=False'])
    assert code == 2
    assert 'error: MaskRCNN: RPNHead with a softmax classifier' in capsys.readouterr().err


@pytest.mark.slow  # one more export (~1 min CPU); the module's parity without a mask head is
# in the default suite (test_faster_rcnn_module_matches_mmdet_predict)
def test_faster_rcnn_exports_through_the_tool_and_matches_in_onnxruntime(tmp_path, capsys):
    """Faster R-CNN (the demo Mask R-CNN without its mask head) through tools/export_onnx.py:
    the four outputs of the other detectors, onnxruntime vs mmdet's predict within the
    tolerances at two sizes, at the score threshold and below it (the tool's check), no mask
    IoU in its report."""
    out = tmp_path / 'faster.onnx'
    code = load_tool('export_onnx.py').main([
        osp.join(REPO_ROOT, MASK_RCNN_CONFIG), '--out', str(out), '--part', 'detector',
        '--check-sizes',
        '96x128', '75x117', '--cfg-options', 'model.roi_head.mask_head=None',
        'model.roi_head.mask_roi_extractor=None', 'model.backbone.depths=[1,1,1]'])
    report = capsys.readouterr().out
    assert code == 0, report
    assert [o.name for o in ort_session(str(out)).get_outputs()] == list(OUTPUT_NAMES)
    rows = [line for line in report.splitlines() if ' detections (PyTorch ' in line]
    # per size: at the RoI head's score_thr (0.05), then at 0 (the raw top-k)
    assert len(rows) == 4 and all(r.endswith('labels equal ok') for r in rows), report
    assert all(int(r.split(': ')[1].split()[0]) > 0 for r in rows), report  # something compared
