"""Crash safety with real process kills: ``tools/train.py`` SIGKILLed mid-iteration, inside a
checkpoint write and between the checkpoint and its ``last_checkpoint`` pointer, each time
resumed with ``--resume``, ends with the weights, EMA weights and optimizer state of an
uninterrupted run of the same seeded command; a full disk while saving is reported and the
previous checkpoint kept.

The moments are reached by ``tests/crash_hooks.py`` (``CRASH_AT``): the process announces that
it is there and waits; the test kills it with SIGKILL, as the OOM killer or a pre-emption would.
"""
import os
import os.path as osp
import signal
import subprocess
import sys
import time
from typing import Dict, Optional

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from helpers import REPO_ROOT, subprocess_env
from mmengine.config import Config

ROOT = str(REPO_ROOT)
TESTS = osp.join(ROOT, 'tests')
TRAIN = osp.join(ROOT, 'tools', 'train.py')
MAX_ITERS, CKPT_INTERVAL = 12, 3
#: a process that neither pauses nor finishes within this fails the test
PROCESS_TIMEOUT_S = 240
PAUSED_FILE = 'paused'


def _config(data_root: str, path: str) -> str:
    cfg = tiny_cfg(data_root, 'unused', max_iters=MAX_ITERS, ckpt_interval=CKPT_INTERVAL,
                   name='crash',
                   custom_hooks=[dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=0.1,
                                      update_buffers=True, priority=49),
                                 dict(type='CrashPointHook')])
    del cfg['work_dir'], cfg['randomness']  # from the command line: --work-dir, --seed
    cfg['custom_imports'] = dict(imports=['vitdet_plugin', 'crash_hooks'],
                                 allow_failed_imports=False)
    cfg['default_hooks']['checkpoint']['max_keep_ckpts'] = 2
    Config(cfg).dump(path)
    return path


def _command(config: str, work_dir: str, resume: bool) -> list:
    return [sys.executable, TRAIN, config, '--work-dir', work_dir, '--seed', '0'] \
        + (['--resume'] if resume else [])


def _env(crash_at: str = '', **extra: str) -> Dict[str, str]:
    env = subprocess_env(False)
    env['PYTHONPATH'] = os.pathsep.join([TESTS, ROOT, env.get('PYTHONPATH', '')])
    env['OMP_NUM_THREADS'] = '1'
    env['CRASH_AT'] = crash_at
    env.update(extra)
    return env


def _run(config: str, work_dir: str, resume: bool = False, crash_at: str = '',
         **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(config, work_dir, resume), env=_env(crash_at, **extra),
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S, cwd=ROOT)


def _kill_at(config: str, work_dir: str, crash_at: str, resume: bool) -> str:
    """Run until the process pauses at ``crash_at``, SIGKILL it; returns where it paused."""
    paused = osp.join(work_dir, PAUSED_FILE)
    if osp.exists(paused):
        os.remove(paused)
    proc = subprocess.Popen(_command(config, work_dir, resume), env=_env(crash_at), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not osp.exists(paused):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f'the run did not reach {crash_at} (exit {proc.returncode}):\n{out}')
        time.sleep(0.1)
    time.sleep(0.2)  # the pause file is written; let the process enter its sleep
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    with open(paused) as f:
        return f.read()


def _pointer(work_dir: str) -> Optional[str]:
    path = osp.join(work_dir, 'last_checkpoint')
    if not osp.exists(path):
        return None
    with open(path) as f:
        return osp.basename(f.read().strip())


def _state(path: str) -> Dict[str, Dict[str, torch.Tensor]]:
    ckpt = torch.load(path, weights_only=True, map_location='cpu')
    optim = {f'{k}.{n}': v for k, s in ckpt['optimizer']['state'].items()
             for n, v in s.items() if isinstance(v, torch.Tensor)}
    return dict(model=ckpt['state_dict'], ema=ckpt['ema_state_dict'], optimizer=optim)


def _assert_same(a: Dict[str, Dict[str, torch.Tensor]],
                 b: Dict[str, Dict[str, torch.Tensor]]) -> None:
    for part in ('model', 'ema', 'optimizer'):
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f'{part} {k} differs'


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp('crash')
    data = make_data(str(root / 'data'))
    config = _config(data, str(root / 'crash_cfg.py'))
    ref_dir = str(root / 'reference')
    done = _run(config, ref_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    return config, ref_dir


def test_killed_at_three_points_resumes_to_the_uninterrupted_weights(setup, tmp_path):
    config, ref_dir = setup
    work = str(tmp_path / 'work')
    # 1. mid-iteration 5: iter_3 is the last checkpoint
    where = _kill_at(config, work, 'forward:5', resume=False)
    assert where == 'forward of iteration 5'
    assert _pointer(work) == 'iter_3.pth'
    # 2. inside the write of iter_6: half of it is on disk, in the .tmp file only
    where = _kill_at(config, work, 'write:6', resume=True)
    assert where.startswith('writing ') and where.endswith('iter_6.pth.tmp')
    partial = osp.join(work, 'iter_6.pth.tmp')
    assert 0 < osp.getsize(partial)
    assert not osp.exists(osp.join(work, 'iter_6.pth'))
    assert _pointer(work) == 'iter_3.pth'  # the partial file is never picked up
    torch.load(osp.join(work, 'iter_3.pth'), weights_only=True)
    # 3. iter_9 complete and renamed, last_checkpoint still at iter_6: resumed from iter_6
    where = _kill_at(config, work, 'pointer:9', resume=True)
    assert where.endswith('iter_9.pth')
    assert _pointer(work) == 'iter_6.pth'
    assert not osp.exists(partial)  # the rewrite of iter_6 replaced it
    # 4. the last resume runs to the end
    done = _run(config, work, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # mmengine's own record of the resume point: iteration 6, not the complete iter_9
    assert 'Advance dataloader 6 steps to skip data that has already been trained' in done.stdout
    assert _pointer(work) == f'iter_{MAX_ITERS}.pth'
    _assert_same(_state(osp.join(work, f'iter_{MAX_ITERS}.pth')),
                 _state(osp.join(ref_dir, f'iter_{MAX_ITERS}.pth')))


def test_full_disk_while_saving_is_reported_and_the_previous_checkpoint_kept(setup, tmp_path):
    config, ref_dir = setup
    work = str(tmp_path / 'work')
    size = osp.getsize(osp.join(ref_dir, f'iter_{MAX_ITERS}.pth'))  # every one is as large
    # from iteration 4 on no file may grow past half a checkpoint: the iter_6 write fails
    done = _run(config, work, crash_at='disk_full:4', CRASH_FILE_LIMIT=str(size // 2))
    assert done.returncode != 0
    first = osp.join(work, f'iter_{CKPT_INTERVAL}.pth')
    message = (f'saving checkpoint {osp.join(work, "iter_6.pth")} failed: OSError: [Errno 27] '
               f'File too large; nothing was written over older files (the previous '
               f'checkpoint {first} is complete and last_checkpoint still points at it). Free '
               'disk space (or raise the quota / file size limit) and continue with '
               'tools/train.py CONFIG --resume')
    assert f'CheckpointSaveError: {message}' in done.stderr
    assert _pointer(work) == 'iter_3.pth'
    assert not osp.exists(osp.join(work, 'iter_6.pth.tmp'))
    torch.load(first, weights_only=True)
    # with room again, the run resumes from iter_3 and ends where the reference does
    resumed = _run(config, work, resume=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    _assert_same(_state(osp.join(work, f'iter_{MAX_ITERS}.pth')),
                 _state(osp.join(ref_dir, f'iter_{MAX_ITERS}.pth')))
