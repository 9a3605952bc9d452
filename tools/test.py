"""Evaluate a checkpoint with an mmengine config (mmdet's tools/test.py, plus vitdet_plugin).

    python tools/test.py CONFIG CHECKPOINT [--data DIR] [--work-dir DIR] [--metrics bbox segm]
                         [--show-dir DIR [--grid N]] [--out results.pkl]
                         [--cfg-options k=v ...] [--launcher pytorch] [--tta]

``--data DIR`` points the config at your data folder as it is (``tools/train.py --data``; the
test split, else the validation split). Prints the metrics and writes them as JSON
(``--metrics-out``, default ``<work_dir>/metrics.json``). ``--show-dir`` saves every test image
with its drawn predictions (ground truth on the left) and ``--grid N`` tiles the first N of them
into ``<show-dir>/grid.png``.
"""
import argparse
import glob
import importlib.util
import json
import math
import numbers
import os
import os.path as osp
import sys
from copy import deepcopy
from typing import Dict, List, Optional

from mmengine.config import ConfigDict, DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import vitdet_plugin  # noqa: F401  (registers our modules, torch/mmengine resume fix)
from vitdet_plugin.checks import (ConfigCheckError, DataCheckError, drop_preflight_hook,
                                  preflight)
from vitdet_plugin.config import DatasetNotFoundError, load_config
from vitdet_plugin.datasets.data_folder import DataFolderError, apply_data_folder
from vitdet_plugin.engine.dist import prepare_cpu_distributed

GRID_TILE = 384  # px, longest side of one tile in --grid


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test (and evaluate) a detector')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--data', metavar='DIR',
                        help='your data folder (as tools/train.py --data): tests on its test '
                        'split, else its validation split')
    parser.add_argument('--work-dir', help='the dir to save logs and metrics '
                        '(default: ./work_dirs/<config name>)')
    parser.add_argument('--metrics', nargs='+', metavar='METRIC',
                        help="evaluate these metrics instead of the config's "
                        "(CocoMetric: 'bbox', 'segm', 'proposal', 'proposal_fast')")
    parser.add_argument('--metrics-out', help='write the metrics as JSON here '
                        '(default: <work_dir>/metrics.json)')
    parser.add_argument('--out', help='dump the raw predictions to this .pkl file')
    parser.add_argument('--show', action='store_true', help='show predictions in a window')
    parser.add_argument('--show-dir', help='save images with drawn predictions here (a relative '
                        'path lies under the work dir, as with mmdet\'s tools/test.py)')
    parser.add_argument('--grid', type=int, default=0, metavar='N',
                        help='with --show-dir: tile the first N drawn images into grid.png')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='score threshold of drawn predictions')
    parser.add_argument('--wait-time', type=float, default=2, help='--show interval (s)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (e.g. data_root=/data/coco/)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--tta', action='store_true', help='flip test-time augmentation')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    if args.grid and not args.show_dir:
        parser.error('--grid needs --show-dir')
    if args.out is not None and not args.out.endswith(('.pkl', '.pickle')):
        parser.error(f'--out {args.out}: the dump file must end in .pkl or .pickle')
    return args


def _set_metrics(evaluator, metrics: List[str]) -> None:
    for ev in evaluator if isinstance(evaluator, list) else [evaluator]:
        if 'metric' in ev:
            ev.metric = metrics if len(metrics) > 1 else metrics[0]


def _add_tta(cfg) -> None:
    if 'tta_model' not in cfg:
        cfg.tta_model = dict(type='DetTTAModel',
                             tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5),
                                          max_per_img=100))
    if 'tta_pipeline' not in cfg:
        data_cfg = cfg.test_dataloader.dataset
        while 'dataset' in data_cfg:
            data_cfg = data_cfg['dataset']
        cfg.tta_pipeline = deepcopy(data_cfg.pipeline)
        cfg.tta_pipeline[-1] = dict(
            type='TestTimeAug',
            transforms=[[dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)],
                        [dict(type='PackDetInputs',
                              meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                         'scale_factor', 'flip', 'flip_direction'))]])
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline


def show_dir_path(show_dir: str, work_dir: str) -> str:
    """Where ``--show-dir`` writes: an absolute path as given, a relative one under the work
    dir (``--show-dir vis`` -> ``<work_dir>/vis``)."""
    return osp.abspath(show_dir if osp.isabs(show_dir) else osp.join(work_dir, show_dir))


def build_cfg(args: argparse.Namespace):
    cfg = load_config(args.config, args.cfg_options)
    if args.data is not None:
        try:
            print(apply_data_folder(cfg, args.data, ('test',), args.cfg_options).line(),
                  flush=True)
        except DataFolderError as e:
            raise SystemExit(f'error: {e}') from None
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    if not osp.isfile(args.checkpoint):
        raise SystemExit(f'error: checkpoint {args.checkpoint!r} does not exist')
    cfg.load_from = args.checkpoint
    if args.metrics:
        _set_metrics(cfg.test_evaluator, args.metrics)
    if args.show or args.show_dir:
        vis = cfg.default_hooks.get('visualization')
        if vis is None or vis.get('type') != 'DetVisualizationHook':
            raise SystemExit('error: --show/--show-dir need default_hooks.visualization='
                             "dict(type='DetVisualizationHook') in the config")
        vis.draw = True
        vis.show = args.show
        vis.wait_time = args.wait_time
        vis.score_thr = args.score_thr
        if args.show_dir:
            # a relative --show-dir lies under the work dir, as mmdet's tools/test.py puts it
            # (DetVisualizationHook joins work_dir/timestamp/test_out_dir; absolute wins)
            args.show_dir = show_dir_path(args.show_dir, cfg.work_dir)
            vis.test_out_dir = args.show_dir
    if args.tta:
        _add_tta(cfg)
    return cfg


def make_grid(image_dir: str, n: int, out_file: str, tile: int = GRID_TILE) -> Optional[str]:
    """Tile the first ``n`` images of ``image_dir`` (sorted by name) into ``out_file``."""
    import cv2
    import numpy as np

    files = sorted(f for f in glob.glob(osp.join(image_dir, '*'))
                   if f.lower().endswith(('.png', '.jpg', '.jpeg')) and
                   osp.abspath(f) != osp.abspath(out_file))[:n]
    if not files:
        return None
    imgs = []
    for f in files:
        img = cv2.imread(f)
        if img is None:
            raise ValueError(f'cannot read image {f} (not an image OpenCV can decode)')
        scale = tile / max(img.shape[:2])
        imgs.append(cv2.resize(img, (round(img.shape[1] * scale), round(img.shape[0] * scale))))
    h = max(i.shape[0] for i in imgs)
    w = max(i.shape[1] for i in imgs)
    cols = math.ceil(math.sqrt(len(imgs)))
    rows = math.ceil(len(imgs) / cols)
    grid = np.full((rows * h, cols * w, 3), 255, np.uint8)
    for k, img in enumerate(imgs):
        r, c = divmod(k, cols)
        grid[r * h:r * h + img.shape[0], c * w:c * w + img.shape[1]] = img
    cv2.imwrite(out_file, grid)
    return out_file


def main(argv=None) -> Dict[str, float]:
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    args = parse_args(argv)
    cfg = build_cfg(args)
    try:  # the checkpoint replaces the init weights: only the model and the data are checked
        preflight(cfg, ('test',), config_path=args.config, tool='tools/test.py', weights=False)
    except (DatasetNotFoundError, ConfigCheckError, DataCheckError) as e:
        sys.exit(f'error: {e}')
    drop_preflight_hook(cfg)  # its checks just ran
    prepare_cpu_distributed(cfg)  # gloo + CPU DDP wrapper when torchrun runs without GPUs
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    if args.out is not None:
        from mmdet.evaluation import DumpDetResults
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    metrics = runner.test()
    if runner.rank != 0:
        return metrics
    # numbers.Real: also numpy scalars (mmdet's SemSegMetric returns np.float32)
    metrics = {k: (float(v) if isinstance(v, numbers.Real) else v) for k, v in metrics.items()}
    out = args.metrics_out or osp.join(cfg.work_dir, 'metrics.json')
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(metrics, f, indent=2)
    print(json.dumps(metrics, indent=2))
    print(f'metrics written to {out}')
    if args.show_dir:
        print(f'drawn predictions in {args.show_dir}')
        if args.grid:
            grid = make_grid(args.show_dir, args.grid, osp.join(args.show_dir, 'grid.png'))
            print(f'prediction grid: {grid}')
    return metrics


if __name__ == '__main__':
    main()
