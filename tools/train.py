"""Train a detector with an mmengine config (mmdet's tools/train.py, plus vitdet_plugin).

    python tools/train.py CONFIG [--data DIR] [--work-dir DIR] [--amp] [--auto-scale-lr]
                          [--resume [CKPT]] [--seed N [--deterministic]]
                          [--cfg-options k=v ...] [--launcher pytorch]

``vitdet_plugin`` is imported (configs work without ``custom_imports``), mmdet's default scope
is set, ``--data DIR`` points the config at your data folder as it is (a Roboflow COCO export or
mmdet's ``annotations/instances_<split>.json`` layout: splits, classes and the heads' class
counts found there, :mod:`vitdet_plugin.datasets.data_folder`), ``--cfg-options data_root=DIR``
moves every dataloader and evaluator path of the config, and before anything is built the config
and the data are checked (``vitdet_plugin.checks``: missing files, backbone / neck / head
mismatches, class counts, bad annotations, one summary line per dataset). ``--seed N`` makes a
run repeatable: the same command on the same machine gives the same weights (deterministic
algorithms on CPU; on CUDA with ``--deterministic``).
Multi-GPU: ``tools/dist_train.sh``.
"""
import argparse
import importlib.util
import os
import os.path as osp
import sys

from mmengine.config import DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import vitdet_plugin  # noqa: F401  (registers our modules, torch/mmengine resume fix)
from vitdet_plugin.checks import (ConfigCheckError, DataCheckError, drop_preflight_hook,
                                  exit_on_report, preflight)
from vitdet_plugin.checks.preflight import report_rank
from vitdet_plugin.config import DatasetNotFoundError, load_config
from vitdet_plugin.datasets.data_folder import DataFolderError, apply_data_folder
from vitdet_plugin.engine.dcp import is_dcp_checkpoint
from vitdet_plugin.engine.dist import prepare_cpu_distributed
from vitdet_plugin.engine.dist_faults import DistributedFaultError, train_with_fault_report
from vitdet_plugin.engine.fsdp_runner import check_fsdp_config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a detector')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--data', metavar='DIR',
                        help='your data folder: a Roboflow COCO export (train/_annotations.coco.'
                        'json, valid/, test/) or annotations/instances_{train,val}.json with '
                        'train/ and val/; sets the datasets, evaluators, classes and num_classes')
    parser.add_argument('--work-dir', help='the dir to save logs and models '
                        '(default: ./work_dirs/<config name>)')
    parser.add_argument('--amp', action='store_true', default=False,
                        help='enable automatic-mixed-precision training (needs a GPU)')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the lr by total batch size / auto_scale_lr.base_batch_size')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint (a file, or a DCP directory of a '
                        'sharded run), or (no value) from the latest checkpoint in the work dir')
    parser.add_argument('--seed', type=int, default=None,
                        help='random seed of the run (python, numpy, torch, data-loader '
                        'workers); on CPU it also turns on deterministic algorithms, so the same '
                        'command on the same machine gives the same weights (default: the '
                        "config's randomness.seed)")
    parser.add_argument('--deterministic', action='store_true',
                        help='with --seed on CUDA: deterministic algorithms and cuDNN too '
                        '(slower; ops without a deterministic CUDA kernel raise)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (e.g. data_root=/data/coco/ '
                        'train_dataloader.batch_size=4); list values as key="[a,b]"')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if args.deterministic and args.seed is None:
        parser.error('--deterministic needs --seed N')
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def run_stages(cfg) -> tuple:
    """The splits a training run reads: train, and val when the config validates."""
    return ('train', 'val') if cfg.get('val_cfg') and cfg.get('val_dataloader') else ('train',)


def build_cfg(args: argparse.Namespace):
    import torch

    cfg = load_config(args.config, args.cfg_options)
    if args.data is not None:
        try:
            folder = apply_data_folder(cfg, args.data, run_stages(cfg), args.cfg_options)
        except DataFolderError as e:
            exit_on_report(e)  # one report per job: rank 0's
        if report_rank() == 0:
            print(folder.line(), flush=True)
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])

    uses_amp = args.amp or cfg.optim_wrapper.get('type') == 'AmpOptimWrapper'
    if uses_amp and not torch.cuda.is_available():
        raise SystemExit('error: automatic mixed precision (--amp or optim_wrapper.type='
                         "'AmpOptimWrapper') needs a CUDA device and none is available; on CPU "
                         "drop --amp / pass --cfg-options optim_wrapper.type=OptimWrapper")
    if args.amp:
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.loss_scale = 'dynamic'

    if args.auto_scale_lr:
        if 'base_batch_size' not in cfg.get('auto_scale_lr', {}):
            raise SystemExit('error: --auto-scale-lr needs auto_scale_lr=dict(enable=False, '
                             f'base_batch_size=N) in {args.config}')
        cfg.auto_scale_lr.enable = True

    if args.seed is not None:
        # deterministic on CPU costs nothing measurable; on CUDA it is opt-in
        deterministic = args.deterministic or not torch.cuda.is_available()
        cfg.randomness = dict(cfg.get('randomness') or {}, seed=args.seed,
                              deterministic=deterministic)

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        if is_dcp_checkpoint(args.resume):
            if cfg.get('runner_type') != 'FSDP2Runner':
                raise SystemExit(f'error: --resume {args.resume}: a DCP checkpoint directory is '
                                 "read by runner_type='FSDP2Runner'; convert it for this config "
                                 f'with python tools/dcp_convert.py {args.resume} FILE.pth')
        elif not osp.isfile(args.resume):
            raise SystemExit(f'error: --resume {args.resume}: no such checkpoint file or DCP '
                             'checkpoint directory (a directory holding .metadata)')
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def main(argv=None) -> None:
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    args = parse_args(argv)
    cfg = build_cfg(args)
    try:
        preflight(cfg, run_stages(cfg), config_path=args.config, tool='tools/train.py')
        check_fsdp_config(cfg)  # FSDP2Wrapper needs FSDP2Runner
    except (DatasetNotFoundError, ConfigCheckError, DataCheckError, ValueError) as e:
        exit_on_report(e)  # one report per job: rank 0's
    drop_preflight_hook(cfg)  # its checks just ran
    prepare_cpu_distributed(cfg)  # gloo + CPU DDP wrapper when torchrun runs without GPUs
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    try:  # a rank that dies is named by the others (one rank: just runner.train())
        train_with_fault_report(runner, config_path=args.config)
    except DistributedFaultError as e:
        sys.exit(f'error: {e}')


if __name__ == '__main__':
    main()
