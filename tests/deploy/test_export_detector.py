"""End-to-end ONNX export (``tools/export_onnx.py --part detector``): uint8 image -> padded
detections, checked in onnxruntime against mmdet's own ``predict`` (SdpaDETR and RetinaNet,
shrunk demo configs with random weights), the numpy + onnxruntime runner (in a subprocess with
torch and mmdet blocked) against mmdet's DetInferencer on image files through
``tools/infer.py``, and the refusals (mmdet FCOS, bad runner input; Mask R-CNN:
test_export_two_stage.py; DINO: test_export_dino.py)."""
import json
import os.path as osp
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from helpers import REPO_ROOT, load_tool, randomize_, subprocess_env

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end import (OUTPUT_NAMES, PAD_LABEL, EndToEndDetector,
                                             add_metadata, check_exportable,
                                             export_end_to_end, pipeline_meta)
from vitdet_plugin.deploy import end_to_end_check
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, SCORE_TOLERANCE, Parity,
                                                   compare, report, untied)
from vitdet_plugin.deploy.onnx_export import build_model
from vitdet_plugin.deploy.ort_check import ort_session
from vitdet_plugin.deploy.runner import META_KEY, OnnxDetector

#: Shrunk demo configs (structure kept: stem Swin + FPN, and the DETR head / RetinaHead).
TINY = {
    'detr': ('configs/demo/swin_detr_shapes.py', {
        'model.backbone.depths': [1, 1, 1],
        'model.bbox_head.embed_dims': 32, 'model.bbox_head.num_heads': 2,
        'model.bbox_head.ffn_dims': 64, 'model.bbox_head.num_decoder_layers': 1,
        'model.bbox_head.num_queries': 20, 'model.test_cfg.max_per_img': 30}),
    'retinanet': ('configs/demo/swin_retinanet_shapes.py', {
        'model.backbone.depths': [1, 1, 1], 'model.bbox_head.stacked_convs': 1}),
}
#: Check images: one multiple of the pad divisor (32), two that are not (padding inside).
SIZES = ((96, 128), (75, 117), (130, 99))


@pytest.fixture(scope='module', params=[
    'detr', pytest.param('retinanet', marks=pytest.mark.slow)])  # export: ~1 min CPU each
def exported(request, tmp_path_factory):
    config, options = TINY[request.param]
    cfg, model = build_model(osp.join(REPO_ROOT, config), cfg_options=dict(options))
    randomize_(model)  # spread-out scores: a ranking to compare
    module = EndToEndDetector(model)
    path = str(tmp_path_factory.mktemp(request.param) / 'model.onnx')
    export_end_to_end(module, path)
    add_metadata(path, pipeline_meta(cfg, module))
    return request.param, model, module, path


def _images(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in SIZES]


def test_graph_matches_mmdet_predict(exported):
    kind, model, module, path = exported
    session = ort_session(path)
    assert [o.name for o in session.get_outputs()] == list(OUTPUT_NAMES)
    assert [isinstance(d, str) for d in session.get_inputs()[0].shape] == [True, False, True,
                                                                         True]
    for p in compare(session, model, _images()):
        assert p.num_onnx == p.num_torch > 0, (kind, p)
        assert p.box_error <= BOX_TOLERANCE and p.score_error <= SCORE_TOLERANCE, (kind, p)
        assert p.labels_equal, (kind, p)


def test_check_compares_the_raw_top_k_when_nothing_lies_above_the_threshold(exported):
    """A model with no detection above its score_thr (an under-trained one; here the
    threshold raised to 1 in the graph and in mmdet's test_cfg alike): a loud warning per size,
    and the raw top-k below the threshold compared and passing."""
    kind, model, module, path = exported
    configured = model.bbox_head.test_cfg.get('score_thr')
    lines = list(report(path, model, _images(), score_thr=1.0))
    assert [(size, line) for size, line, _ in lines[::2]] == [
        (f'{h}x{w}', f'  WARNING {h}x{w}: no detection above score_thr 1 (onnxruntime 0, '
                     'PyTorch 0): compared below it only') for h, w in SIZES]
    k = module.max_per_img
    for (h, w), (size, line, passed) in zip(SIZES, lines[1::2]):
        assert size == f'{h}x{w}'
        assert line.startswith(f'  {h}x{w} at score_thr 0 (the raw top-k): {k} detections '
                               f'(PyTorch {k}), box error '), line
        assert line.endswith(', labels equal ok') and passed, line
    assert model.bbox_head.test_cfg.get('score_thr') == configured  # mmdet's test_cfg restored


def test_a_size_with_nothing_to_compare_fails(exported, monkeypatch):
    """A size where neither side detects anything at a threshold of 0: the check fails there
    (it used to print "0 detections (PyTorch 0) ... ok")."""
    empty = Parity(size=(96, 128), num_onnx=0, num_torch=0, box_error=0.0, score_error=0.0,
                   labels_equal=True)
    monkeypatch.setattr(end_to_end_check, 'compare', lambda *args: [empty])
    assert list(report(exported[3], exported[1], _images()[:1], score_thr=0.0)) == [
        ('96x128', '  96x128: no detection to compare (onnxruntime 0, PyTorch 0) FAILED', False)]


def test_batch_rows_are_the_single_images_and_padding_follows_the_contract(exported):
    kind, _, module, path = exported
    session = ort_session(path)
    images = torch.stack([_images(1)[1], _images(2)[1]]).numpy()   # two 75 x 117 images
    boxes, scores, labels, num = session.run(None, {'image': images})
    k = module.max_per_img
    assert boxes.shape == (2, k, 4) and scores.shape == labels.shape == (2, k)
    assert labels.dtype == num.dtype == np.int64 and boxes.dtype == np.float32
    for b in range(2):
        one = session.run(None, {'image': images[b:b + 1]})
        np.testing.assert_allclose(boxes[b], one[0][0], atol=1e-3)
        np.testing.assert_allclose(scores[b], one[1][0], atol=SCORE_TOLERANCE)
        n = int(num[b])
        assert np.all(np.diff(scores[b, :n]) <= 0)
        assert np.all(scores[b, n:] == 0) and np.all(boxes[b, n:] == 0)
        assert np.all(labels[b, n:] == PAD_LABEL) and np.all(labels[b, :n] >= 0)
        assert np.all(boxes[b, :n, 2] <= 117) and np.all(boxes[b, :n, 3] <= 75)


def _write_images(folder, sizes=((150, 210), (192, 192))):
    g = np.random.default_rng(0)
    folder.mkdir()
    for i, (h, w) in enumerate(sizes):
        image = g.integers(0, 256, (h, w, 3), dtype=np.uint8)
        cv2.rectangle(image, (20, 30), (90, 110), (255, 255, 255), -1)
        cv2.imwrite(str(folder / f'{i:03d}.png'), image)
    return folder


#: Runs tools/infer.py with torch and mmdet unimportable.
BLOCKED_RUN = ('import runpy, sys\n'
               'for m in ("torch", "mmdet", "mmengine", "mmcv"): sys.modules[m] = None\n'
               'sys.argv = sys.argv[1:]\n'
               'runpy.run_path(sys.argv[0], run_name="__main__")\n')


def test_infer_onnxruntime_without_torch_equals_pytorch_backend(exported, tmp_path):
    """tools/infer.py on a folder: the onnxruntime backend in a subprocess that cannot import
    torch or mmdet (resize, run, boxes mapped back to the original image) gives the
    PyTorch backend's (mmdet's DetInferencer) detections."""
    kind, model, _, path = exported
    config, options = TINY[kind]
    folder = _write_images(tmp_path / 'images')
    env = subprocess_env(no_site=False, PYTHONPATH=REPO_ROOT)
    ort_out = tmp_path / 'ort'
    infer = osp.join(REPO_ROOT, 'tools', 'infer.py')
    run = subprocess.run([sys.executable, '-c', BLOCKED_RUN, infer,
                          str(folder), '--out-dir', str(ort_out), '--backend', 'onnxruntime',
                          '--onnx', path], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (ort_out / '000.png').is_file()
    ckpt = tmp_path / 'model.pth'
    classes = OnnxDetector(path).classes
    torch.save({'state_dict': model.state_dict(), 'meta': {'dataset_meta': {'classes': classes}}},
               ckpt)
    tool = load_tool('infer.py')
    cfg_path = tmp_path / 'tiny.py'
    cfg_path.write_text(_config_text(config, options))
    assert tool.main([str(folder), '--out-dir', str(tmp_path / 'pt'), '--backend', 'pytorch',
                      '--config', str(cfg_path), '--checkpoint', str(ckpt), '--no-draw']) == 0
    ort = json.loads((ort_out / 'predictions.json').read_text())
    pt = json.loads((tmp_path / 'pt' / 'predictions.json').read_text())
    assert ort['images'] == pt['images'] and ort['categories'] == pt['categories']
    for image in ort['images']:
        a = [d for d in ort['annotations'] if d['image_id'] == image['id']]
        b = [d for d in pt['annotations'] if d['image_id'] == image['id']]
        assert len(a) == len(b) > 0
        side = max(image['width'], image['height'])
        scores_a, scores_b = (np.array([d['score'] for d in x]) for x in (a, b))
        np.testing.assert_allclose(scores_a, scores_b, atol=SCORE_TOLERANCE, rtol=0)
        ranks = untied(scores_b)  # a tie may be ordered either way
        boxes_a, boxes_b = (np.array([d['bbox'] for d in x])[ranks] for x in (a, b))
        np.testing.assert_allclose(boxes_a, boxes_b, atol=BOX_TOLERANCE * side, rtol=0)
        assert [d['category_id'] for d, keep in zip(a, ranks) if keep] == \
            [d['category_id'] for d, keep in zip(b, ranks) if keep]


def _config_text(config: str, options: dict) -> str:
    """A config file: ``config`` with ``options`` (dotted keys) applied."""
    from vitdet_plugin.config import load_config
    cfg = load_config(osp.join(REPO_ROOT, config), dict(options))
    cfg.model.backbone.init_cfg = None
    return cfg.pretty_text


def test_runner_refuses_bad_images(exported):
    detector = OnnxDetector(exported[3])
    assert detector.session.get_modelmeta().custom_metadata_map[META_KEY]
    with pytest.raises(ValueError, match=r'image shape is \(40, 50, 4\); expected \(H, W, 3\)'):
        detector(np.zeros((40, 50, 4), np.uint8))
    with pytest.raises(TypeError, match='image dtype is float32; the graph takes uint8'):
        detector(np.zeros((40, 50, 3), np.float32))


def test_detectors_that_cannot_export_are_refused(capsys):
    """mmdet's FCOS (a head the graph does not decode). (Two-stage refusals:
    test_export_two_stage.py, DINO's: test_export_dino.py.)"""
    import mmdet
    fcos = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', 'fcos',
                    'fcos_r50-caffe_fpn_gn-head_1x_coco.py')
    _, model = build_model(fcos, cfg_options={'model.backbone.init_cfg': None})
    with pytest.raises(ValueError, match=r'FCOS with FCOSHead: no end-to-end export \(supported: '
                                         r'SdpaDETR with SdpaDETRHead'):
        check_exportable(model)
    code = load_tool('export_onnx.py').main([fcos, '--out', 'x.onnx', '--part', 'detector',
                                         '--cfg-options', 'model.backbone.init_cfg=None'])
    assert code == 2
    assert 'error: FCOS with FCOSHead: no end-to-end export' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_tool('export_onnx.py').parse_args(['c.py', '--out', 'x.onnx', '--part', 'trunk'])
    assert "invalid choice: 'trunk'" in capsys.readouterr().err
