"""FSDP2 sharded training under mmengine (vitdet_plugin.engine.fsdp / fsdp_runner) on 2 gloo
ranks: one torchrun job (tests/fsdp_worker.py) checked against a single-process run.

The 2-rank step (one image per rank) must give the losses, gathered gradients and updated
weights of one process accumulating the same two images over two iterations
(``accumulative_counts=2``: the same mean of the two gradients); each rank holds about half of
the parameters and optimizer state; resuming from the first checkpoint continues
bit-identically; the checkpoint is a plain full state dict that one process loads strictly;
a model built on rank 0 only (the others on the meta device) trains identically.
"""
import json
import math
import os
import os.path as osp
import subprocess
import sys
import time

import pytest
import torch

import vitdet_plugin  # noqa: F401
from dist_worker import make_data
from fsdp_worker import AMP_DEVICE_CHECK, TRAIN_ITERS, amp_cfg, register_recorder, vit_cfg
from test_distributed import _free_port
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
WORKER = osp.join(ROOT, 'tests', 'fsdp_worker.py')
WORLD_SIZE = 2
JOB_TIMEOUT_S = 240
#: fp32, relative L2 error of each tensor: the sharded step reduces the same sums in another
#: order (measured 2026-12-02: at most 6.6e-7 here)
TOL = 1e-6
#: the trained weights after the second AdamW step: the first step's error, amplified where
#: AdamW divides tiny gradients by their tiny second moments (measured 2026-12-02: 2.2e-6);
#: the averaged weights of that step stay within TOL
SECOND_STEP_TOL = 1e-5
#: bf16 autocast against fp32: relative loss difference, a few bf16 roundings (bf16 keeps 8
#: significant bits: 2^-8 each); measured 2026-12-02: 3.4e-3
BF16_TOL = 2 ** -6
#: a rank's share of the bytes: 1/2, give or take the parameters a world of 2 cannot split
#: evenly (odd first dims: one more row on rank 0)
SHARE_SLACK = 0.02


def torchrun(mode: str, data: str, work: str, *extra: str, timeout: float = JOB_TIMEOUT_S,
             worker: str = WORKER, nproc: int = WORLD_SIZE) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           worker, mode, data, work, *extra]
    return subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True,
                          timeout=timeout)


def _single_process_reference(data: str, work: str):
    """The same model, seed and images on one process (FSDP2Runner, no wrapper: the same
    weights init as the sharded run): batch 1, gradients of 2 iterations accumulated into each
    optimizer step (the lr milestone after the first step), mmengine's own EMAHook updating
    after each optimizer step (as in a DDP run of 2 ranks); checkpoints after each step."""
    from mmengine.config import Config
    from mmengine.hooks import EMAHook
    from mmengine.registry import HOOKS, RUNNERS
    register_recorder()

    @HOOKS.register_module(force=True)
    class StepEMAHook(EMAHook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            if (runner.iter + 1) % WORLD_SIZE == 0:  # an optimizer step was taken
                super().after_train_iter(runner, batch_idx, data_batch, outputs)

    cfg = vit_cfg(data, work, WORLD_SIZE * TRAIN_ITERS, WORLD_SIZE, 1, 'none',
                  experiment_name='single')
    cfg['optim_wrapper']['accumulative_counts'] = WORLD_SIZE
    cfg['param_scheduler'][0]['milestones'] = [WORLD_SIZE]
    for hook in cfg['custom_hooks']:
        if hook['type'] == 'EMAHook':
            hook['type'] = 'StepEMAHook'
    cfg['runner_type'] = 'FSDP2Runner'  # launcher 'none': one process, no wrapper
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    return next(h for h in runner.hooks if type(h).__name__ == 'FsdpRecorder'), cfg


def _single_process_amp_losses(data: str, work: str) -> list:
    """The losses of the first two images on one process under ``AmpOptimWrapper`` (bf16)."""
    from mmengine.config import Config
    from mmengine.registry import RUNNERS
    cfg = amp_cfg(vit_cfg(data, work, WORLD_SIZE, WORLD_SIZE, 1, 'none',
                          experiment_name='single_amp'))
    cfg['optim_wrapper']['accumulative_counts'] = WORLD_SIZE
    cfg['runner_type'] = 'FSDP2Runner'
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    return next(h for h in runner.hooks if type(h).__name__ == 'FsdpRecorder').losses


@pytest.fixture(scope='module')
def fsdp_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fsdp')
    data = make_data(str(tmp / 'data'))
    work = str(tmp / 'work')
    os.makedirs(work)
    job = torchrun('train', data, work)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    ranks = [json.load(open(osp.join(work, f'rank{r}.json'))) for r in range(WORLD_SIZE)]
    return data, work, ranks


def test_fsdp_step_equals_single_process_shares_bytes_resumes_bit_identically(
        fsdp_job, tmp_path, monkeypatch):
    data, work, ranks = fsdp_job
    ref, ref_cfg = _single_process_reference(data, str(tmp_path / 'single'))
    for res in ranks:
        assert res['wrapper'] == 'FSDP2Wrapper'
        assert res['param_types'] == ['DTensor']
        assert (res['ema_hook'], res['ema_types']) == ('FSDP2EMAHook', ['DTensor'])
    # the loss of rank r's image is the single process's loss at iteration r
    for r in range(WORLD_SIZE):
        assert abs(ranks[r]['losses'][0] - ref.losses[r]) <= TOL * abs(ref.losses[r]), \
            (r, ranks[r]['losses'][0], ref.losses[r])

    # AmpOptimWrapper (bf16 autocast) on the sharded model: the single process's AMP losses,
    # within bf16 rounding of the fp32 ones
    monkeypatch.setattr('.'.join(AMP_DEVICE_CHECK), lambda: True)
    amp = _single_process_amp_losses(data, str(tmp_path / 'single_amp'))
    print('AMP / fp32 loss rel. difference', [abs(a - f) / f for a, f in zip(amp, ref.losses)])
    for r in range(WORLD_SIZE):
        assert abs(ranks[r]['amp_losses'][0] - amp[r]) <= TOL * abs(amp[r]), (r, amp)
        assert 0 < abs(amp[r] - ref.losses[r]) <= BF16_TOL * abs(ref.losses[r]), (r, amp)

    grads = torch.load(osp.join(work, 'grads.pt'), weights_only=True)
    assert grads.keys() == ref.grads.keys()
    assert not any(k.startswith('backbone.patch_embed') for k in grads)  # frozen_stages=0
    for name, g in grads.items():
        assert rel_l2(g, ref.grads[name]) <= TOL, (name, rel_l2(g, ref.grads[name]))
    print('max grad rel. L2 error', max(rel_l2(g, ref.grads[n]) for n, g in grads.items()))

    # the checkpoint after the sharded step: full tensors, the single process's weights
    fsdp_ckpt = torch.load(osp.join(work, 'fsdp', 'iter_1.pth'), weights_only=False)
    single = torch.load(osp.join(str(tmp_path / 'single'), f'iter_{WORLD_SIZE}.pth'),
                        weights_only=False)
    assert fsdp_ckpt['state_dict'].keys() == single['state_dict'].keys()
    for name, w in fsdp_ckpt['state_dict'].items():
        assert type(w) is torch.Tensor, name
        assert rel_l2(w, single['state_dict'][name]) <= TOL, name

    # EMA: after each step the checkpoint holds mmengine EMAHook's form (``state_dict``: the
    # averaged weights, ``ema_state_dict``: ``steps`` + ``module.<name>``: the trained ones)
    # with the single process's values, the average of the second step included
    single_2 = torch.load(osp.join(str(tmp_path / 'single'), f'iter_{WORLD_SIZE * TRAIN_ITERS}'
                                   '.pth'), weights_only=False)
    fsdp_2 = torch.load(osp.join(work, 'fsdp', f'iter_{TRAIN_ITERS}.pth'), weights_only=False)
    for step, (ours, theirs) in enumerate(((fsdp_ckpt, single), (fsdp_2, single_2)), 1):
        assert list(ours['ema_state_dict']) == list(theirs['ema_state_dict'])
        for key in ('state_dict', 'ema_state_dict'):
            tol = SECOND_STEP_TOL if (step, key) == (2, 'ema_state_dict') else TOL
            for name, w in ours[key].items():
                assert type(w) is torch.Tensor and w.dtype == theirs[key][name].dtype, name
                assert w.shape == theirs[key][name].shape, name
                if w.is_floating_point():
                    assert rel_l2(w, theirs[key][name]) <= tol, (step, key, name)
                else:
                    assert torch.equal(w, theirs[key][name]), (step, key, name)
            print('step', step, key, 'max rel. L2 error', max(
                rel_l2(w, theirs[key][n]) for n, w in ours[key].items() if w.is_floating_point()))
    assert int(fsdp_2['ema_state_dict']['steps']) == TRAIN_ITERS
    # validation runs the averaged weights, training continues with the trained ones
    swap = torch.load(osp.join(work, 'ema_swap.pt'), weights_only=True)
    for name, w in fsdp_2['state_dict'].items():
        assert torch.equal(swap['val'][name], w), name
        assert torch.equal(swap['after'][name], fsdp_2['ema_state_dict']['module.' + name]), name
    moved = max(rel_l2(fsdp_2['state_dict'][k], fsdp_2['ema_state_dict']['module.' + k])
                for k in fsdp_2['state_dict'] if fsdp_2['state_dict'][k].is_floating_point())
    assert moved > 100 * TOL, moved  # the average is not the trained weights

    # one process (tools/test.py's way) loads it strictly
    from mmdet.registry import MODELS
    from mmengine.runner import load_checkpoint
    model = MODELS.build(ref_cfg['model'])
    load_checkpoint(model, osp.join(work, 'fsdp', 'iter_1.pth'), strict=True)
    for name, w in model.state_dict().items():
        assert torch.equal(w, fsdp_ckpt['state_dict'][name]), name

    # each rank: about half of the parameter and AdamW state bytes, from its local shards
    total = ranks[0]['bytes']['total_params']
    trainable = ranks[0]['bytes']['trainable_params']
    assert sum(res['bytes']['local_params'] for res in ranks) == total
    for res in ranks:
        assert abs(res['bytes']['local_params'] / total - 0.5) <= SHARE_SLACK, res['bytes']
        # exp_avg + exp_avg_sq of the trainable parameters' shards
        assert abs(res['bytes']['local_optim'] / (2 * trainable) - 0.5) <= SHARE_SLACK, \
            res['bytes']

    # resumed from iter_1.pth: the second iteration and its checkpoint are bit-identical
    for res in ranks:
        assert res['resumed_losses'] == res['losses'][1:]
    resumed = torch.load(osp.join(work, 'resume', f'iter_{TRAIN_ITERS}.pth'), weights_only=False)
    straight = torch.load(osp.join(work, 'fsdp', f'iter_{TRAIN_ITERS}.pth'), weights_only=False)
    for key in ('state_dict', 'ema_state_dict'):
        assert resumed[key].keys() == straight[key].keys()
        for name, w in straight[key].items():
            assert torch.equal(resumed[key][name], w), (key, name)
    for key in ('state', 'param_groups'):
        assert _flat(resumed['optimizer'][key]) == _flat(straight['optimizer'][key]), key
    assert resumed['param_schedulers'] == straight['param_schedulers']

    # init_on_rank0: rank 1 built its model on the meta device and got its shards from rank 0:
    # the first step's losses and weights are the ones of the run that built it everywhere
    assert [res['built_on_meta'] for res in ranks] == [False, True]
    for res in ranks:
        assert res['rank0_init_losses'] == res['losses'][:1]
    rank0_init = torch.load(osp.join(work, 'rank0_init', 'iter_1.pth'), weights_only=False)
    for name, w in fsdp_ckpt['state_dict'].items():
        assert torch.equal(rank0_init['state_dict'][name], w), name


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (L2 norms over the whole tensor; 0 when both are 0)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _flat(node):
    """Nested containers of tensors as comparable values (tensors -> (dtype, shape, bytes))."""
    if isinstance(node, torch.Tensor):
        return (str(node.dtype), tuple(node.shape), node.numpy().tobytes())
    if isinstance(node, dict):
        return {k: _flat(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_flat(v) for v in node]
    return node


@pytest.mark.slow
def test_fsdp_configs_train_a_shrunk_step_on_two_ranks(tmp_path):
    """Each shipped FSDP config (model, layer decay, runner, wrapper), shrunk, trains one
    iteration on 2 gloo ranks with finite losses."""
    from fsdp_shrink import FSDP_CONFIGS
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    job = torchrun('configs', data, work, *[osp.join(ROOT, p) for p in FSDP_CONFIGS],
                   timeout=2 * JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    for path in FSDP_CONFIGS:
        res = json.load(open(osp.join(work, osp.basename(path)[:-3] + '.json')))
        assert res['wrapper'] == 'FSDP2Wrapper' and res['iter'] == 1, res
        assert len(res['losses']) == 1 and math.isfinite(res['losses'][0]), res


@pytest.mark.slow
def test_rank_killed_mid_run_other_exits_within_bound_last_checkpoint_loads(tmp_path):
    """Rank 1 SIGKILLs itself at iteration 4 of a sharded run (checkpoints every 2): the job
    ends within the fault-handling bound of tests/engine/test_dist_faults.py and iter_2.pth, written
    before the kill, loads strictly on one process."""
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from test_dist_faults import EXIT_BOUND_S

    from fsdp_worker import KILL_AT_ITER, KILL_CKPT_INTERVAL
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONUNBUFFERED='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD_SIZE}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           WORKER, 'kill', data, work]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed_at, lines = None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and 'rank 1: SIGKILL at iteration' in line:
                killed_at = time.monotonic()
        proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    assert killed_at is not None, ''.join(lines[-60:])
    assert proc.returncode != 0
    assert ended - killed_at <= EXIT_BOUND_S, (ended - killed_at, ''.join(lines[-40:]))
    last = KILL_CKPT_INTERVAL * ((KILL_AT_ITER - 1) // KILL_CKPT_INTERVAL)
    ckpt = osp.join(work, f'iter_{last}.pth')
    init_default_scope('mmdet')
    model = MODELS.build(vit_cfg(data, work, 1, 1, 1, 'none')['model'])
    load_checkpoint(model, ckpt, strict=True)
    assert torch.load(ckpt, weights_only=False)['meta']['iter'] == last


def test_config_mistakes_are_refused_with_the_fix():
    from vitdet_plugin.engine.fsdp import FSDP2Wrapper, mixed_precision_policy
    from vitdet_plugin.engine.fsdp_runner import check_fsdp_config
    check_fsdp_config(dict(model_wrapper_cfg=dict(type='MMDistributedDataParallel')))  # DDP
    with pytest.raises(ValueError, match=r"^model_wrapper_cfg\.type='FSDP2Wrapper' needs "
                       r"runner_type='FSDP2Runner' in the config"):
        check_fsdp_config(dict(model_wrapper_cfg=dict(type='FSDP2Wrapper')))
    with pytest.raises(ValueError, match=r"model_wrapper_cfg\.type='MMDistributedDataParallel' "
                       r"is not it: drop model_wrapper_cfg or set type='FSDP2Wrapper'$"):
        check_fsdp_config(dict(runner_type='FSDP2Runner',
                               model_wrapper_cfg=dict(type='MMDistributedDataParallel')))
    check_fsdp_config(dict(runner_type='FSDP2Runner', custom_hooks=[dict(type='EMAHook')]))
    with pytest.raises(ValueError, match=r"^MyEMAHook is not supported with FSDP2Runner \(only "
                       r"mmengine's EMAHook gets sharded averaged weights, as FSDP2EMAHook\); "
                       r"use type='EMAHook' or train with DDP$"):
        check_fsdp_config(dict(runner_type='FSDP2Runner', launcher='pytorch',
                               custom_hooks=[dict(type='MyEMAHook')]))
    amp = dict(runner_type='FSDP2Runner', launcher='pytorch',
               optim_wrapper=dict(type='AmpOptimWrapper', dtype='bfloat16'))
    with pytest.raises(ValueError, match=r'^optim_wrapper AmpOptimWrapper with FSDP2Runner needs '
                       r'use_fsdp=True \(ShardedGradScaler: .*\); or use FSDP2Wrapper'):
        check_fsdp_config(amp)
    amp['optim_wrapper']['use_fsdp'] = True
    check_fsdp_config(amp)
    from vitdet_plugin.engine.fsdp_ema import FSDP2EMAHook
    with pytest.raises(ValueError, match=r'^EMAHook\(device=\.\.\.\) is not supported with '
                       r'FSDP2Runner: .* drop device$'):
        FSDP2EMAHook(device='cpu')
    with pytest.raises(ValueError, match=r"^mixed_precision\.param_dtype='bf16' is not one of "
                       r"\['bfloat16', 'float16', 'float32'\]"):
        mixed_precision_policy(dict(param_dtype='bf16'))
    with pytest.raises(ValueError, match=r"^mixed_precision has unknown keys \['dtype'\]"):
        mixed_precision_policy(dict(dtype='bfloat16'))
    policy = mixed_precision_policy(dict(param_dtype='bfloat16', reduce_dtype='float32'))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(RuntimeError, match=r'^FSDP2Wrapper needs an initialised process group'):
        FSDP2Wrapper(torch.nn.Linear(2, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only refusal')
def test_cpu_offload_without_cuda_is_refused(monkeypatch):
    from vitdet_plugin.engine.fsdp import FSDP2Wrapper
    monkeypatch.setattr(torch.distributed, 'is_initialized', lambda: True)
    with pytest.raises(ValueError, match=r'^FSDP2Wrapper\(cpu_offload=True\) moves the shards of '
                       r'a GPU model to host memory; without CUDA .* set cpu_offload=False$'):
        FSDP2Wrapper(torch.nn.Linear(2, 2), cpu_offload=True)
