"""Reproducible runs: the `make demo` config trained twice by tools/train.py with the same seed
(the demo schedule's ``randomness.seed=0``, deterministic) gives bit-identical weights, EMA
weights and optimizer state, with its data-loader workers and augmentations as configured;
``--seed 1`` gives other weights (so the comparison can fail)."""
import os.path as osp
import subprocess
import sys
from typing import Dict, List

import torch
from helpers import REPO_ROOT, subprocess_env

from vitdet_plugin.datasets import generate_dataset

ROOT = str(REPO_ROOT)
DEMO = osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py')
ITERS = 3
IMAGES = 4
RUN_TIMEOUT_S = 300


def _train(data_root: str, work_dir: str, extra: List[str]) -> Dict[str, torch.Tensor]:
    options = [f'data_root={data_root}', f'train_cfg.max_iters={ITERS}',
               'train_cfg.val_interval=1000000', 'custom_hooks.0.minutes=1000000',
               f'train_dataloader.batch_size={IMAGES // 2}']
    done = subprocess.run([sys.executable, osp.join(ROOT, 'tools', 'train.py'), DEMO,
                           '--work-dir', work_dir, *extra, '--cfg-options', *options],
                          env=subprocess_env(False), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ckpt = torch.load(osp.join(work_dir, f'iter_{ITERS}.pth'), weights_only=True)
    flat = {f'model.{k}': v for k, v in ckpt['state_dict'].items()}
    flat.update({f'ema.{k}': v for k, v in ckpt['ema_state_dict'].items()})
    flat.update({f'optim.{i}.{n}': v for i, s in ckpt['optimizer']['state'].items()
                 for n, v in s.items() if isinstance(v, torch.Tensor)})
    return flat


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    data = str(tmp_path / 'shapes') + '/'
    generate_dataset(data, seed=5, num_train=IMAGES, num_val=1, progress=False)
    first = _train(data, str(tmp_path / 'a'), [])
    second = _train(data, str(tmp_path / 'b'), [])
    assert first.keys() == second.keys()
    assert [k for k in first if not torch.equal(first[k], second[k])] == []
    other = _train(data, str(tmp_path / 'c'), ['--seed', '1'])
    assert any(not torch.equal(first[k], other[k]) for k in first if k.startswith('model.'))
