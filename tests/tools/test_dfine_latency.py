"""``tools/benchmark.py --dfine-latency`` (tools/dev/bench/dfine_latency.py): each preset's
transformers model has exactly our detector's tensors (strict conversion); on a
tiny D-FINE loaded from transformers' folder, the uint8 -> top-k reference graph module equals
transformers' ``post_process_object_detection`` and ours' ``predict``; the sameness check
refuses two different models; unknown sizes are refused; slow: transformers' graph through
the dynamo exporter equals the module. The timed run itself (minutes of CPU) is not in the
suite."""
import os.path as osp

import numpy as np
import pytest
import torch
from helpers import REPO_ROOT, TINY_DFINE_MODEL

SIDE = 64


@pytest.fixture
def latency(monkeypatch):
    """``dev.bench.dfine_latency`` as ``python tools/benchmark.py`` sees it."""
    monkeypatch.syspath_prepend(osp.join(str(REPO_ROOT), 'tools'))
    import dev.bench.dfine_latency
    return dev.bench.dfine_latency


@pytest.mark.parametrize('name', ['dfine_n', 'deimv2_n', 'deimv2_s'])
def test_preset_is_the_transformers_model_of_its_size(latency, name):
    from mmdet.registry import MODELS
    from transformers import DFineForObjectDetection, Deimv2ForObjectDetection

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.weights.dfine_detector import dfine_to_detector
    cfg = latency.model_config(name)
    config = latency.reference_config(cfg)
    assert type(config).__name__ == ('DFineConfig' if name == 'dfine_n' else 'Deimv2Config')
    cls = DFineForObjectDetection if name == 'dfine_n' else Deimv2ForObjectDetection
    ours, theirs = MODELS.build(cfg), cls(config)
    expected = {k: v.shape for k, v in ours.state_dict().items()}
    converted, _ = dfine_to_detector(theirs.state_dict(), expected)  # strict: names and shapes
    assert set(converted) == set(expected)


def test_reference_graph_module_is_transformers_post_processing(latency, tmp_path):
    from transformers import RTDetrImageProcessor

    from vitdet_plugin.deploy.end_to_end_check import mmdet_predict
    config = tmp_path / 'tiny_dfine.py'
    config.write_text(TINY_DFINE_MODEL)
    theirs, ours = latency.build_pair(str(config), str(tmp_path / 'transformers'))
    pre = ours.data_preprocessor
    module = latency.ReferenceEndToEnd(theirs, pre.mean.flatten(), pre.std.flatten()).eval()
    g = torch.Generator().manual_seed(1)
    image = torch.randint(0, 256, (3, SIDE, SIDE), dtype=torch.uint8, generator=g)
    with torch.no_grad():
        boxes, scores, labels = module(image[None])
        out = theirs(pixel_values=image[None].flip(1).float() / 255)
    want = RTDetrImageProcessor().post_process_object_detection(
        out, threshold=0.0, target_sizes=[(SIDE, SIDE)])[0]
    assert torch.equal(labels[0], want['labels'])
    assert torch.allclose(scores[0], want['scores'], atol=1e-6)
    assert torch.allclose(boxes[0], want['boxes'], atol=1e-4)
    assert scores[0].std() > 1e-3  # perturbed weights: the queries' scores differ
    ours_boxes, ours_scores, ours_labels = mmdet_predict(ours, image)
    np.testing.assert_array_equal(ours_labels, want['labels'].numpy())
    errors = latency.check_same('eager', (ours_boxes, ours_scores),
                                (want['boxes'].numpy(), want['scores'].numpy()), SIDE)
    assert errors[0] <= latency.SCORE_TOLERANCE and errors[1] <= latency.BOX_TOLERANCE


def test_different_models_are_refused(latency):
    boxes = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 20.0, 20.0]])
    scores = np.array([0.9, 0.5])
    assert latency.check_same('x', (boxes, scores), (boxes, scores), SIDE) == (0.0, 0.0)
    with pytest.raises(RuntimeError, match=r'onnxruntime, ours vs transformers: the top '
                                           r'detections differ \(scores by 1\.0e-02, boxes by '
                                           r'inf of the side; limits 1e-04, 1e-03\): the '
                                           r'two sides are not the same model'):
        latency.check_same('onnxruntime, ours vs transformers', (boxes, scores),
                           (boxes, scores + 0.01), SIDE)


def test_unknown_size_is_refused(latency):
    with pytest.raises(ValueError, match=r"--dfine-latency 'deimv2_q' is neither a preset "
                                         r"\['deimv2_n', 'deimv2_s', 'dfine_n'\] nor a config "
                                         r'file; give one of them'):
        latency.model_config('deimv2_q')


def test_near_equal_scores_may_swap_their_boxes(latency):
    """Two detections whose scores differ by 1e-7 come in either order on the two sides."""
    boxes = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 20.0, 20.0]])
    scores = np.array([0.9, 0.9 - 1e-7])
    assert latency.check_same('x', (boxes, scores), (boxes[::-1], scores), SIDE)[1] == 0.0
    apart = np.array([0.9, 0.5])  # the same scores, the boxes of the other detection
    with pytest.raises(RuntimeError, match=r'scores by 0\.0e\+00, boxes by 1\.6e-01 of the'):
        latency.check_same('x', (boxes, apart), (boxes[::-1], apart), SIDE)


@pytest.mark.slow  # an export (15-50 s of CPU); the module's function: the test above
def test_reference_graph_exports_with_the_dynamo_exporter(latency, tmp_path):
    """transformers' D-FINE through torch's dynamo exporter (its ``torch._check`` translated):
    onnxruntime gives the module's detections."""
    from vitdet_plugin.deploy.ort_check import ort_session
    config = tmp_path / 'tiny_dfine.py'
    config.write_text(TINY_DFINE_MODEL)
    theirs, ours = latency.build_pair(str(config), str(tmp_path / 'transformers'))
    pre = ours.data_preprocessor
    module = latency.ReferenceEndToEnd(theirs, pre.mean.flatten(), pre.std.flatten()).eval()
    image = torch.randint(0, 256, (1, 3, SIDE, SIDE), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(2))
    path = str(tmp_path / 'theirs.onnx')
    assert latency._export_reference(module, image, path) == ('dynamo', [])
    boxes, scores, _ = ort_session(path).run(None, {'image': image.numpy()})
    with torch.no_grad():
        want = module(image)
    np.testing.assert_allclose(scores[0], want[1][0].numpy(), atol=1e-6)
    np.testing.assert_allclose(boxes[0], want[0][0].numpy(), atol=1e-3)
