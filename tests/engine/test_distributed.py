"""Distributed data-parallel training: 2 CPU processes (gloo) launched with torchrun, in the
default suite (about 30 s): TimeBudgetHook decisions shared by all ranks, AtomicCheckpointHook.

The config freezes stage 0 and uses activation checkpointing, and wraps the model with
``MMDistributedDataParallel(find_unused_parameters=False)``: frozen parameters have
``requires_grad=False`` and non-reentrant checkpointing keeps every trainable parameter in the
autograd graph, so DDP needs no unused-parameter search (it would raise on iteration 2
otherwise). Both ranks must finish and hold bit-identical weights.
"""
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest
import torch
from dist_worker import BUDGET_S, SECONDS_PER_ITER, make_data

import vitdet_plugin  # noqa: F401
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
WORLD_SIZE = 2
#: a rank that plans its own (shorter) end leaves the other blocked in all-reduce: the run
#: then hangs until this limit
DDP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_ddp_two_cpu_ranks_time_budget_atomic_checkpoints_frozen_with_cp(tmp_path):
    """Rank 1's clock runs 2.5x slower than rank 0's (and it sleeps): rank 0 alone plans the
    end, so both ranks run BUDGET_S / 1 s = 12 iterations with the same learning rates (the
    cosine re-targeted to end at 12) and identical weights. Checkpoints every 5 iterations
    with max_keep_ckpts=1 leave only the last one."""
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD_SIZE}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           osp.join(ROOT, 'tests', 'dist_worker.py'), data, work]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=DDP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    expected_iters = int(BUDGET_S / SECONDS_PER_ITER[0])
    ranks = [torch.load(osp.join(work, f'rank{r}.pt'), weights_only=True)
             for r in range(WORLD_SIZE)]
    for r, res in enumerate(ranks):
        assert res['world_size'] == WORLD_SIZE
        assert (res['iter'], res['max_iters']) == (expected_iters, expected_iters), r
        assert res['wrapper'] == 'MMDistributedDataParallel'
        # stage 1's second block ran through non-reentrant activation checkpointing
        assert res['checkpoint_calls'] and set(res['checkpoint_calls']) == {False}
        assert res['frozen_requires_grad'] and not any(res['frozen_requires_grad'])
        assert len(res['lrs']) == expected_iters
    assert ranks[1]['lrs'] == ranks[0]['lrs']
    lrs = ranks[0]['lrs']
    assert lrs[-1] < 0.05 * max(lrs), lrs  # the cosine was re-targeted to end at 12, not 100
    ref = ranks[0]['state']
    for r in range(1, WORLD_SIZE):
        assert ranks[r]['state'].keys() == ref.keys()
        for key, value in ref.items():
            assert torch.equal(ranks[r]['state'][key], value), f'rank {r} differs at {key}'
    # AtomicCheckpointHook (interval 5, max_keep_ckpts=1): 5, 10, then the last iteration
    assert sorted(f for f in os.listdir(work) if f.endswith(('.pth', '.tmp'))) == \
        [f'iter_{expected_iters}.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, f'iter_{expected_iters}.pth')
    assert torch.load(osp.join(work, f'iter_{expected_iters}.pth'),
                      weights_only=True)['meta']['iter'] == expected_iters


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only behaviour')
def test_prepare_cpu_distributed_needs_torchrun_env(monkeypatch):
    from vitdet_plugin.engine.dist import prepare_cpu_distributed
    assert prepare_cpu_distributed(dict(launcher='none')) is False
    for var in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"launcher='pytorch' needs the torchrun environment "
                       r"variables .*\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are "
                       r'not set\. Start the job with tools/dist_train\.sh'):
        prepare_cpu_distributed(dict(launcher='pytorch'))


def _thread_names() -> list:
    """Names of this process's native threads (Linux: /proc/self/task/*/comm)."""
    return [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]


def test_end_distributed_destroys_the_group_and_joins_the_gloo_threads(tmp_path):
    """The atexit handler of every multi-rank process: after it no gloo worker thread is left
    to outlive the interpreter (docs/training.md#distributed-training)."""
    import torch.distributed as dist

    from vitdet_plugin.engine.dist import end_distributed
    assert not dist.is_initialized()
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0,
                            world_size=1)
    dist.all_reduce(torch.ones(2))
    assert 'pt_gloo_runloop' in _thread_names()
    end_distributed()
    assert not dist.is_initialized()
    assert 'pt_gloo_runloop' not in _thread_names()
    end_distributed()  # without a group: nothing


#: one FSDP2 rank (world 1, torchrun's environment) that uses what pins a process group: a
#: DTensor (torch._dynamo, DTensor's caches of the mesh) and ShardedGradScaler (its default
#: ``process_group=dist.group.WORLD``), dropped as the runner is at exit; then the atexit
#: handler; prints whether the scaler's module was not imported before, and the gloo threads left
FSDP_END = '''
import os, sys
import torch
from torch import nn
from vitdet_plugin.engine.dist import end_distributed, prepare_cpu_distributed
fresh = 'torch.distributed.fsdp.sharded_grad_scaler' not in sys.modules
prepare_cpu_distributed(dict(launcher='pytorch', runner_type='FSDP2Runner'))
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
model = fully_shard(nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
scaler = ShardedGradScaler(device='cpu')
del model, scaler  # as at exit: the runner is gone
end_distributed()
names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]
print('fresh', fresh, 'gloo', sum('gloo' in n for n in names))
'''


def test_fsdp2_process_ends_without_gloo_threads():
    """FSDP2 pins the process group twice (see ``PINNING_IMPORTS`` and ``release_mesh_groups``
    in vitdet_plugin.engine.dist): without both fixes gloo's 3 threads are still running when
    the interpreter finalises, the race behind rank 1's SIGABRT at exit (docs/large_models.md)."""
    env = dict(os.environ, RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS='1')
    job = subprocess.run([sys.executable, '-c', FSDP_END], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=DDP_TIMEOUT_S)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.split()[-4:] == ['fresh', 'True', 'gloo', '0'], job.stderr[-2000:]
