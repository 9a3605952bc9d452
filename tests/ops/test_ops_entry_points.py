"""Every way a user starts a detector runs mmdet's mmcv ops on the compile-free backend, each in
a fresh interpreter: mmdet's own ``tools/train.py`` (the script ``mim train mmdet`` runs:
``mmdet/.mim/tools/train.py``) through ``custom_imports``, without the .pth hook (our
``tools/train.py`` / ``tools/test.py`` run the same way in tests/tools/test_tools.py);
``mmdet.apis.init_detector`` / ``inference_detector`` and a plain ``import mmdet.models``,
which import ``mmcv.ops`` before anything of ours, through the hook. The detector is the lean
Mask R-CNN demo: RPN ``batched_nms`` and ``RoIAlign`` run in training and inference (mmcv-lite
has no other way to run them)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mmdet
import pytest
from helpers import REPO_ROOT, subprocess_env

ROOT = REPO_ROOT
CONFIG = ROOT / 'configs' / 'demo' / 'swin_mask_rcnn_shapes.py'
MMDET_TRAIN = Path(mmdet.__file__).parent / '.mim' / 'tools' / 'train.py'
OURS = 'vitdet_plugin.ops'
ITERS = 1


@pytest.fixture(scope='module')
def shapes(tmp_path_factory) -> str:
    from vitdet_plugin.datasets import generate_dataset
    root = tmp_path_factory.mktemp('entry_shapes')
    generate_dataset(str(root), seed=2, num_train=4, num_val=2, progress=False)
    return str(root) + '/'


def _run(args, cwd: Path, no_site: bool = False) -> str:
    cmd = [sys.executable] + (['-S'] if no_site else []) + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(no_site, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _train_options(data_root: str):
    """Plain mmengine overrides (mmdet's script knows no ``data_root=`` shortcut)."""
    paths = [f'{loader}.dataset.data_root={data_root}'
             for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    paths += [f'{evaluator}.ann_file={data_root}annotations/instances_val.json'
              for evaluator in ('val_evaluator', 'test_evaluator')]
    return ['--cfg-options', *paths, f'train_cfg.max_iters={ITERS}',
            f'train_cfg.val_interval={ITERS}', 'train_dataloader.batch_size=2',
            'train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
            'val_dataloader.num_workers=0', 'val_dataloader.persistent_workers=False',
            'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False',
            'default_hooks.logger.interval=1', 'model.test_cfg.rcnn.score_thr=0.0']


def test_mmdet_train_script_without_the_hook(shapes, tmp_path):
    """custom_imports puts the ops in place before the runner builds the model, so training and
    the final validation run even without the .pth."""
    out = _run([MMDET_TRAIN, CONFIG, '--work-dir', tmp_path / 'work'] + _train_options(shapes),
               cwd=tmp_path, no_site=True)
    assert f'Iter(train) [{ITERS}/{ITERS}]' in out
    assert 'coco/segm_mAP' in out  # validation: RPN nms and RoIAlign at inference


INFERENCE = textwrap.dedent('''
    import json, sys
    import numpy as np
    from mmdet.apis import inference_detector, init_detector  # imports mmcv.ops
    before = 'vitdet_plugin' in sys.modules
    import mmcv._ext
    from mmengine.config import Config
    cfg = Config.fromfile(sys.argv[1])
    cfg.model.test_cfg.rcnn.score_thr = 0.0
    model = init_detector(cfg, device='cpu')  # custom_imports: registers vitdet_plugin
    image = np.random.default_rng(0).integers(0, 255, (160, 224, 3), dtype=np.uint8)
    result = inference_detector(model, image)
    print('REPORT', json.dumps({'plugin_before_mmcv_ops': before, 'backend': mmcv._ext.BACKEND,
                      'boxes': list(result.pred_instances.bboxes.shape),
                      'masks': list(result.pred_instances.masks.shape)}))
''')


def _report(out: str) -> dict:
    (line,) = [ln for ln in out.splitlines() if ln.startswith('REPORT ')]
    return json.loads(line[len('REPORT '):])


def test_init_detector_and_inference_through_the_hook(tmp_path):
    report = _report(_run(['-c', INFERENCE, CONFIG], cwd=tmp_path))
    assert report['plugin_before_mmcv_ops'] is False and report['backend'] == OURS
    num = report['boxes'][0]
    assert report['boxes'] == [num, 4] and report['masks'] == [num, 160, 224] and num > 0


PLAIN = textwrap.dedent('''
    import json, sys, torch
    import mmdet.models  # noqa: F401  (mmcv.ops first of all)
    from mmcv.ops import batched_nms
    from mmcv import _ext
    boxes = torch.tensor([[0., 0, 10, 10], [1, 1, 10, 10], [0, 0, 10, 10]])
    dets, keep = batched_nms(boxes, torch.tensor([.9, .8, .7]), torch.tensor([0, 0, 1]),
                             dict(type='nms', iou_threshold=0.5))
    print('REPORT', json.dumps({'plugin_imported': 'vitdet_plugin' in sys.modules,
                      'backend': _ext.BACKEND, 'keep': keep.tolist()}))
''')


def test_plain_import_mmdet_models_through_the_hook(tmp_path):
    report = _report(_run(['-c', PLAIN], cwd=tmp_path))
    assert report == {'plugin_imported': True, 'backend': OURS, 'keep': [0, 2]}
