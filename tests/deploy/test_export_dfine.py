"""End-to-end ONNX export of a tiny D-FINE (``HGNetV2Backbone`` -> ``HybridEncoder`` ->
``DFineHead``, seeded random weights): the head's own test path traced. Default suite: the
graph's module in PyTorch vs mmdet's ``predict`` on a padded batch; slow: exported through
``tools/export_onnx.py --part detector``, onnxruntime vs mmdet's ``predict`` at two sizes (one
non-square, padded)."""
import os.path as osp

import pytest
import torch
from helpers import REPO_ROOT, load_tool, randomize_
from test_export_rfdetr import _images, check_module_matches_predict

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.end_to_end_check import (BOX_TOLERANCE, SCORE_TOLERANCE, compare,
                                                   threshold_session)
from vitdet_plugin.deploy.onnx_export import build_model

#: The shapes demo's data and pipelines (5 classes) with a tiny D-FINE: a 4-stage HGNetV2
#: (strides 8 / 16 / 32 out), a 32-wide hybrid encoder, a 2-layer decoder of 10 queries.
CONFIG = f"""
_base_ = '{osp.join(REPO_ROOT, 'configs', 'demo', 'swin_detr_shapes.py')}'
model = dict(
    _delete_=True,
    type='SingleStageDetector',
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[0.0, 0.0, 0.0],
                           std=[255.0, 255.0, 255.0], bgr_to_rgb=True, pad_size_divisor=32),
    backbone=dict(type='HGNetV2Backbone', out_indices=(1, 2, 3), use_lab=True,
                  arch=dict(stem_channels=(3, 8, 8), in_channels=(8, 16, 24, 32),
                            mid_channels=(8, 8, 8, 16), out_channels=(16, 24, 32, 48),
                            num_blocks=(1, 1, 1, 1), num_layers=(2, 2, 2, 2),
                            downsample=(False, True, True, True),
                            light_block=(False, False, True, True),
                            kernel_size=(3, 3, 5, 5))),
    neck=dict(type='HybridEncoder', in_channels=(24, 32, 48), in_strides=(8, 16, 32),
              hidden_dim=32, num_heads=4, ffn_dim=64, expansion=0.5, depth_mult=0.34),
    bbox_head=dict(type='DFineHead', num_classes=5, in_channels=(32, 32, 32), embed_dims=32,
                   num_queries=10, num_heads=4, ffn_dims=64, num_layers=2, num_points=(3, 2, 4),
                   num_denoising=8),
    test_cfg=dict(max_per_img=10))
"""
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
