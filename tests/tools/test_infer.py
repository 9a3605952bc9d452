"""tools/infer.py --ann-file on a folder holding more images than the annotation file (the
one-folder layout: train and val images side by side, val's annotations): the others are
skipped and named in one line, the mAP is pycocotools' over the images the file holds; a file
that holds none of them is refused in one line. The detector is replaced by the ground truth's
own boxes (its backend is tested in tests/deploy/), so the mAP is exactly 1."""
import json

import cv2
import numpy as np
import pytest
from helpers import load_tool

from vitdet_plugin.deploy.runner import Detections

#: val's images and their one box each (x, y, w, h); train's images are not in val.json.
VAL = {'0002.png': [10.0, 20.0, 30.0, 25.0], '0004.png': [5.0, 5.0, 40.0, 40.0]}
TRAIN = ('0001.png', '0003.png', '0005.png', '0006.png')
SIZE = 64


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / 'images'
    images.mkdir()
    for name in (*VAL, *TRAIN):
        cv2.imwrite(str(images / name), np.zeros((SIZE, SIZE, 3), np.uint8))
    val = dict(images=[dict(id=10 + i, file_name=f'images/{n}', width=SIZE, height=SIZE)
                       for i, n in enumerate(VAL)],
               annotations=[dict(id=i + 1, image_id=10 + i, category_id=7, bbox=box,
                                 area=box[2] * box[3], iscrowd=0)
                            for i, box in enumerate(VAL.values())],
               categories=[dict(id=7, name='star')])
    (tmp_path / 'val.json').write_text(json.dumps(val))
    return tmp_path


def _ground_truth_detector(files, model):
    """Each image's val box (none for train's) with score 0.9, class 0 ('star')."""
    dets = []
    for path in files:
        boxes = [VAL[p] for p in VAL if path.endswith(p)]
        xyxy = np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], np.float32)
        dets.append(Detections(boxes=xyxy.reshape(-1, 4), scores=np.full(len(boxes), 0.9),
                               labels=np.zeros(len(boxes), np.int64)))
    return dets, ['star']


def test_images_missing_from_the_ann_file_are_skipped_and_named(folder, monkeypatch, capsys):
    tool = load_tool('infer.py')
    monkeypatch.setattr(tool, 'run_onnxruntime', _ground_truth_detector)
    ann = str(folder / 'val.json')
    assert tool.main([str(folder / 'images'), '--out-dir', str(folder / 'out'), '--onnx',
                      'm.onnx', '--no-draw', '--ann-file', ann]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f'--ann-file {ann}: skipped 4 of 6 images that it does not hold: 0001.png, ' \
           '0003.png, 0005.png, ...' in lines
    assert 'COCO bbox mAP 1.0000 (onnxruntime, 2 images)' in lines


def test_an_ann_file_of_other_images_is_refused_in_one_line(folder, monkeypatch, capsys):
    tool = load_tool('infer.py')
    monkeypatch.setattr(tool, 'run_onnxruntime', _ground_truth_detector)
    ann = str(folder / 'val.json')
    assert tool.main([*(str(folder / 'images' / n) for n in TRAIN[:2]), '--out-dir',
                      str(folder / 'out'), '--onnx', 'm.onnx', '--no-draw', '--ann-file',
                      ann]) == 2
    assert capsys.readouterr().err == (
        f'error: --ann-file {ann} holds none of the 2 images (matched by file name: 0001.png, '
        '0003.png); give the annotation file of these images\n')
