"""End-to-end ONNX export of a tiny D-FINE (``HGNetV2Backbone`` -> ``HybridEncoder`` ->
``DFineHead``, seeded random weights): the head's own test path traced. Default suite: the
graph's module in PyTorch vs mmdet's ``predict`` on a padded batch; slow: exported through
``tools/export_onnx.py --part detector``, onnxruntime vs mmdet's ``predict`` at two sizes (one
non-square, padded)."""
import os.path as osp

import pytest
import torch
from helpers import REPO_ROOT, TINY_DFINE_MODEL, load_tool, randomize_
from test_export_rfdetr import _images, check_module_matches_predict

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, SCORE_TOLERANCE, compare,
                                                   threshold_session)
from vitdet_plugin.deploy.onnx_export import build_model

#: The shapes demo's data and pipelines (5 classes) with the tiny D-FINE of the helpers (its
#: model replaces the base's).
CONFIG = (f"_base_ = '{osp.join(REPO_ROOT, 'configs', 'demo', 'swin_detr_shapes.py')}'\n"
          + TINY_DFINE_MODEL.replace('model = dict(\n', 'model = dict(\n    _delete_=True,\n', 1))
#: Check images: one a multiple of the pad divisor (32), one not (padded).
SIZES = ((64, 96), (75, 117))
WEIGHT_SEED = 3
MAX_PER_IMG = 10


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp('dfine_cfg') / 'tiny_dfine.py'
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture(scope='module')
def model(config):
    return randomize_(build_model(config)[1], seed=WEIGHT_SEED).eval()


def test_module_matches_mmdet_predict_in_pytorch(model):
    check_module_matches_predict(model, 'dfine', MAX_PER_IMG)


@pytest.mark.slow
def test_graph_matches_mmdet_predict(config, model, tmp_path):
    ckpt, path = str(tmp_path / 'dfine.pth'), str(tmp_path / 'dfine.onnx')
    torch.save({'state_dict': model.state_dict(),
                'meta': {'dataset_meta': {'classes': ['a', 'b', 'c', 'd', 'e']}}}, ckpt)
    assert load_tool('export_onnx.py').main([config, ckpt, '--out', path, '--part', 'detector',
                                             '--check-sizes', '57x91']) == 0
    session, _ = threshold_session(path)
    for p in compare(session, model, _images(0, SIZES)):
        assert p.num_onnx == p.num_torch == MAX_PER_IMG, p
        assert p.box_error <= BOX_TOLERANCE and p.score_error <= SCORE_TOLERANCE, p
        assert p.labels_equal, p
