"""The smaller first-hour fixes of issue 38: --show-dir under the work dir in tools/test.py, a
one-line refusal from tools/export_onnx.py (the nominal strides: tests/visualization/)."""
import os.path as osp

from helpers import REPO_ROOT, load_tool

ROOT = str(REPO_ROOT)


def _tool(path: str):
    return load_tool(path[len('tools/'):])


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
