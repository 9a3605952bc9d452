"""The DEIMv2 CPU demo (``configs/demo/deimv2_shapes.py``, ``make demo-deimv2``) ships: default
suite: its detector (seeded random weights) as the export's module in PyTorch vs mmdet's
``predict``; slow: a checkpoint of the demo config written by ``tools/train.py`` (a few
iterations on a small generated shapes set) exported through ``tools/export_onnx.py --part
detector``, and onnxruntime's COCO bbox mAP on the val split (``tools/infer.py --ann-file``)
equal to ``tools/test.py``'s within :data:`MAP_TOLERANCE`, every image's scores equal.

``DEIMV2_DEMO_CHECKPOINT=PATH`` (and ``DEIMV2_DEMO_DATA=DIR``, default ``data/shapes/``) runs
the slow test on that checkpoint and data instead (``make demo-deimv2``'s, on the whole val
split)."""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO_ROOT, load_tool, randomize_, subprocess_env
from test_export_rfdetr import check_module_matches_predict

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end_check import SCORE_TOLERANCE
from vitdet_plugin.deploy.onnx_export import build_model

CONFIG = str(REPO_ROOT / 'configs' / 'demo' / 'deimv2_shapes.py')
#: the demo's detections per image (its test_cfg.max_per_img)
MAX_PER_IMG = 100
#: COCO bbox mAP of onnxruntime vs tools/test.py (mmdet reports 3 decimals)
MAP_TOLERANCE = 0.005
#: the slow test's own checkpoint: training iterations and images of its generated shapes set
TRAIN_ITERS = 4
NUM_TRAIN, NUM_VAL = 8, 6


def test_demo_detector_module_matches_mmdet_predict_in_pytorch():
    model = randomize_(build_model(CONFIG)[1], seed=3).eval()
    check_module_matches_predict(model, 'dfine', MAX_PER_IMG)


def _python(args, cwd):
    """A tool in a fresh interpreter (``python -S``, as tests/tools/test_tools.py runs them)."""
    proc = subprocess.run([sys.executable, '-S'] + args, cwd=cwd, capture_output=True,
                          text=True, timeout=1200,
                          env=subprocess_env(True, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope='module')
def demo_checkpoint(tmp_path_factory):
    """``(checkpoint, data root)``: the environment's, else a short run of the demo config."""
    if os.environ.get('DEIMV2_DEMO_CHECKPOINT'):
        data = os.environ.get('DEIMV2_DEMO_DATA', str(REPO_ROOT / 'data' / 'shapes'))
        return (os.path.abspath(os.environ['DEIMV2_DEMO_CHECKPOINT']),
                os.path.abspath(data) + '/')
    from vitdet_plugin.datasets import generate_dataset
    tmp = tmp_path_factory.mktemp('deimv2_demo')
    data = str(tmp / 'shapes') + '/'
    generate_dataset(data, seed=1, num_train=NUM_TRAIN, num_val=NUM_VAL, progress=False)
    _python([str(REPO_ROOT / 'tools' / 'train.py'), CONFIG, '--work-dir', str(tmp / 'work'),
             '--cfg-options', f'data_root={data}', f'train_cfg.max_iters={TRAIN_ITERS}',
             f'train_cfg.val_interval={TRAIN_ITERS}', 'custom_hooks.0.minutes=1000000',
             'train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
             'val_dataloader.num_workers=0', 'val_dataloader.persistent_workers=False'],
            cwd=tmp)
    return str(tmp / 'work' / f'iter_{TRAIN_ITERS}.pth'), data


@pytest.mark.slow
def test_onnxruntime_map_equals_tools_test_map(demo_checkpoint, tmp_path):
    ckpt, data = demo_checkpoint
    ann_file = data + 'annotations/instances_val.json'
    onnx = str(tmp_path / 'deimv2_demo.onnx')
    assert load_tool('export_onnx.py').main([CONFIG, ckpt, '--out', onnx, '--part',
                                             'detector']) == 0
    out = _python([str(REPO_ROOT / 'tools' / 'infer.py'), data + 'val', '--out-dir',
                   str(tmp_path / 'ort'), '--onnx', onnx, '--no-draw', '--ann-file', ann_file],
                  cwd=tmp_path)
    num_val = len(json.load(open(ann_file))['images'])
    line = next(ln for ln in out.splitlines() if ln.startswith('COCO bbox mAP'))
    assert line.endswith(f'(onnxruntime, {num_val} images)'), line
    ort_map = float(line.split()[3])

    metrics = str(tmp_path / 'metrics.json')
    _python([str(REPO_ROOT / 'tools' / 'test.py'), CONFIG, ckpt, '--work-dir',
             str(tmp_path / 'test'), '--metrics-out', metrics, '--out',
             str(tmp_path / 'preds.pkl'), '--cfg-options', f'data_root={data}',
             'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False'],
            cwd=tmp_path)
    torch_map = json.load(open(metrics))['coco/bbox_mAP']
    print(f'COCO bbox mAP: onnxruntime {ort_map:.4f}, tools/test.py {torch_map:.3f}')
    assert abs(ort_map - torch_map) <= MAP_TOLERANCE, (ort_map, torch_map)

    # every image's detections: onnxruntime's scores are tools/test.py's
    ort = json.load(open(tmp_path / 'ort' / 'predictions.json'))['annotations']
    with open(tmp_path / 'preds.pkl', 'rb') as f:
        preds = pickle.load(f)
    assert len(preds) == num_val
    for p in preds:
        want = np.sort(p['pred_instances']['scores'].numpy())[::-1]
        got = np.sort([a['score'] for a in ort if a['image_id'] == p['img_id']])[::-1]
        assert len(got) == len(want) == MAX_PER_IMG, (p['img_id'], len(got), len(want))
        np.testing.assert_allclose(got, want, atol=SCORE_TOLERANCE, rtol=0)
