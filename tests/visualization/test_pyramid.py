"""The nominal strides that tools/analysis/feature_shapes.py prints (a first-hour fix of issue
38: an 800x1216 input's extra levels read stride 64, not 61.5385x64)."""
import pytest

from vitdet_plugin.visualization.pyramid import nominal_stride


@pytest.mark.parametrize('input_hw, map_hw, want', [
    ((800, 1216), (100, 152), '8'),
    ((800, 1216), (13, 19), '64'),     # was 61.5385x64
    ((800, 1216), (7, 10), '128'),     # was 114.286x121.6
    ((800, 1216), (57, 86), '14'),     # a patch-14 ViT: floor(800 / 14) = 57
    ((800, 1216), (100, 100), '8x12.16'),  # no integer stride gives this map
])
def test_nominal_stride(input_hw, map_hw, want):
    assert nominal_stride(input_hw, map_hw) == want
