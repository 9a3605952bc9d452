"""The smaller first-hour fixes of issue 38: nominal strides in feature_shapes.py, --show-dir
under the work dir in tools/test.py, a one-line refusal from tools/export_onnx.py."""
import os.path as osp

import pytest
from helpers import REPO_ROOT, load_tool

ROOT = str(REPO_ROOT)


def _tool(path: str):
    return load_tool(path[len('tools/'):])


@pytest.mark.parametrize('input_hw, map_hw, want', [
    ((800, 1216), (100, 152), '8'),
    ((800, 1216), (13, 19), '64'),     # was 61.5385x64
    ((800, 1216), (7, 10), '128'),     # was 114.286x121.6
    ((800, 1216), (57, 86), '14'),     # a patch-14 ViT: floor(800 / 14) = 57
    ((800, 1216), (100, 100), '8x12.16'),  # no integer stride gives this map
])
def test_nominal_stride(input_hw, map_hw, want):
    assert _tool('tools/analysis/feature_shapes.py').nominal_stride(input_hw, map_hw) == want


def test_show_dir_lies_under_the_work_dir(tmp_path):
    test = _tool('tools/test.py')
    work = str(tmp_path / 'work')
    assert test.show_dir_path('vis', work) == osp.join(work, 'vis')
    assert test.show_dir_path(str(tmp_path / 'abs'), work) == str(tmp_path / 'abs')


def test_export_head_of_a_two_stage_detector_is_one_line(tmp_path, capsys):
    tool = _tool('tools/export_onnx.py')
    config = osp.join(ROOT, 'configs', 'demo', 'swin_mask_rcnn_shapes.py')
    code = tool.main([config, '--out', str(tmp_path / 'm.onnx'), '--part', 'head'])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ('error: MaskRCNN is a two-stage detector: its RoI head needs '
                   'RoIAlign (an mmcv op) and proposals from NMS, which this exporter leaves '
                   'out; export part="neck" (or use mmdeploy)\n')
    assert not (tmp_path / 'm.onnx').exists()
