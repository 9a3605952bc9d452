"""Distributed data-parallel training: 2 CPU processes (gloo) launched with torchrun.

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

import vitdet_plugin  # noqa: F401
from dist_worker import make_data

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_cpu_ranks_frozen_stages_with_cp(tmp_path):
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD_SIZE}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           osp.join(ROOT, 'tests', 'dist_worker.py'), data, work]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    ranks = [torch.load(osp.join(work, f'rank{r}.pt'), weights_only=True)
             for r in range(WORLD_SIZE)]
    for r, res in enumerate(ranks):
        assert res['world_size'] == WORLD_SIZE and res['iter'] == 3, (r, res['iter'])
        assert res['wrapper'] == 'MMDistributedDataParallel'
        # stage 1's second block ran through non-reentrant activation checkpointing
        assert res['checkpoint_calls'] and set(res['checkpoint_calls']) == {False}
        assert res['frozen_requires_grad'] and not any(res['frozen_requires_grad'])
    ref = ranks[0]['state']
    for r in range(1, WORLD_SIZE):
        assert ranks[r]['state'].keys() == ref.keys()
        for key, value in ref.items():
            assert torch.equal(ranks[r]['state'][key], value), f'rank {r} differs at {key}'


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
