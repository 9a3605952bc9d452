"""Per-rank entry point of tests/engine/test_dist_faults.py: the tiny DDP config of dist_worker,
with a rank that fails on purpose at a given iteration.

    python tests/dist_fault_worker.py DATA_ROOT WORK_DIR MODE FAULT_RANK FAULT_ITER \
        MAX_ITERS CKPT_INTERVAL TIMEOUT_S [WRAP [HANG_GRACE_S]]

MODE is ``raise`` (a ValueError), ``kill`` (SIGKILL to itself), ``hang`` (sleeps, alive) or
``none``; FAULT_ITER is 1-based (the ``Iter(train) [k/N]`` of the log). ``TIMEOUT_S`` becomes
``env_cfg.dist_cfg.timeout`` (``0``: the default). With WRAP ``1`` (default) training runs
under :func:`vitdet_plugin.engine.dist_faults.train_with_fault_report`; ``0`` calls
``runner.train()`` bare (the measurements of the undecorated behaviour). Started by torchrun
or with the RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK environment set by hand.

    python tests/dist_fault_worker.py --launch SPEC.json

is such a launcher without torchrun (a multi-node / SLURM job): it imports everything once,
then forks every rank of every job of the spec (``jobs``: name, port, args, logs), each child
with its own RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and its output in its
log, and writes each child's exit status and the time it was seen gone to ``result``. A child
ends as a process started as ``python tests/dist_fault_worker.py ARGS`` does: an exception goes
through the interpreter's excepthook and teardown (exit status 1). One import instead of one
per process: 9 s of CPU each on the 2-core CI machine.
"""
import json
import os
import signal
import sys
import time
from typing import Dict, Optional, Tuple

FAULT_MESSAGE = 'injected fault'
#: a hung rank sleeps this long (the test's subprocess timeout ends it first)
HANG_S = 3600.0


def _register_fault_hook() -> None:
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    @HOOKS.register_module(force=True)
    class InjectFaultHook(Hook):
        """On ``rank`` at iteration ``at_iter`` (1-based): raise, SIGKILL itself or hang."""
        priority = 'VERY_HIGH'

        def __init__(self, mode: str, rank: int, at_iter: int) -> None:
            self.mode, self.rank, self.at_iter = mode, rank, at_iter

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            if int(os.environ['RANK']) != self.rank or runner.iter + 1 != self.at_iter:
                return
            print(f'rank {self.rank}: injecting {self.mode} at iteration {self.at_iter} '
                  f't={time.time():.3f}', flush=True)
            if self.mode == 'raise':
                raise ValueError(FAULT_MESSAGE)
            if self.mode == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == 'hang':
                time.sleep(HANG_S)


def main(argv) -> None:
    import torch
    from dist_worker import tiny_cfg
    from mmengine.config import Config
    from mmengine.runner import Runner

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.engine.dist import prepare_cpu_distributed
    from vitdet_plugin.engine.dist_faults import HANG_GRACE_S, train_with_fault_report
    data_root, work_dir, mode, fault_rank, fault_iter, max_iters, ckpt, timeout = argv[:8]
    wrap = argv[8] != '0' if len(argv) > 8 else True
    grace = float(argv[9]) if len(argv) > 9 else HANG_GRACE_S
    torch.set_num_threads(1)
    _register_fault_hook()
    dist_cfg: dict = dict(backend='gloo')
    if float(timeout) > 0:
        dist_cfg['timeout'] = float(timeout)
    cfg = tiny_cfg(data_root, work_dir, max_iters=int(max_iters), ckpt_interval=int(ckpt),
                   name='faults',
                   custom_hooks=[dict(type='InjectFaultHook', mode=mode, rank=int(fault_rank),
                                      at_iter=int(fault_iter))],
                   launcher='pytorch',
                   env_cfg=dict(cudnn_benchmark=False, dist_cfg=dist_cfg),
                   model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                          find_unused_parameters=False))
    prepare_cpu_distributed(cfg)
    runner = Runner.from_cfg(Config(cfg))
    print(f'rank {os.environ["RANK"]}: training t={time.time():.3f}', flush=True)
    if wrap:
        train_with_fault_report(runner, config_path='CONFIG', hang_grace_s=grace)
    else:
        runner.train()
    print(f'rank {os.environ["RANK"]}: finished t={time.time():.3f}', flush=True)


def _run_rank(job: dict, rank: int) -> None:
    """In a forked child: this rank's environment and log, then :func:`main` (never returns:
    ``sys.exit(0)``, or the exception propagates to the top of the interpreter)."""
    fd = os.open(job['logs'][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job['world_size']),
                      MASTER_ADDR='127.0.0.1', MASTER_PORT=str(job['port']))
    main(job['args'])
    sys.exit(0)


def launch(spec_path: str) -> None:
    import torch
    from mmdet.utils import register_all_modules
    from mmengine.runner import Runner  # noqa: F401

    import vitdet_plugin  # noqa: F401
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    register_all_modules(init_default_scope=False)
    threads = os.listdir('/proc/self/task') if os.path.isdir('/proc/self/task') else ['1']
    assert len(threads) == 1, f'fork with {len(threads)} threads: set OMP_NUM_THREADS=1'
    children: Dict[int, Tuple[str, int]] = {}
    for job in spec['jobs']:
        for rank in range(job['world_size']):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_rank(job, rank)
            children[pid] = (job['name'], rank)
    status: Dict[str, Dict[int, Tuple[Optional[int], float]]] = {
        job['name']: {} for job in spec['jobs']}
    deadline = time.time() + spec['timeout_s']
    while children and time.time() < deadline:
        pid, code = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(spec.get('poll_s', 0.05))
            continue
        name, rank = children.pop(pid)
        status[name][rank] = (os.waitstatus_to_exitcode(code), time.time())
    for pid, (name, rank) in children.items():  # past the deadline: hung
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status[name][rank] = (None, float('inf'))
    with open(spec['result'], 'w') as f:
        json.dump({name: [status[name][r] for r in sorted(status[name])] for name in status}, f)


if __name__ == '__main__':
    if sys.argv[1] == '--launch':
        launch(sys.argv[2])
    else:
        main(sys.argv[1:])
