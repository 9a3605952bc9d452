"""Test-only hook that pauses a training process at a chosen moment so the test can SIGKILL it
there (imported by the configs of tests/engine/test_crash_resume.py through ``custom_imports``).

``CRASH_AT=<point>:<iteration>`` in the environment picks the moment; the process writes
``<work_dir>/paused`` (its content names the point) and sleeps until it is killed:

* ``forward:N``    inside the model's forward of iteration N (mid-iteration);
* ``write:N``      inside the write of checkpoint ``iter_N.pth``: half of its bytes are on disk
                   (in the ``.tmp`` file AtomicCheckpointHook renames when complete);
* ``pointer:N``    after ``iter_N.pth`` is complete and renamed, before ``last_checkpoint`` is
                   rewritten to point at it;
* ``sigkill:N``    not a pause: the process (only rank ``CRASH_RANK`` when that is set)
                   SIGKILLs itself before iteration N, as the OOM killer would;
* ``disk_full:N``  not a pause: from iteration N on, files may not grow past
                   ``CRASH_FILE_LIMIT`` bytes (``RLIMIT_FSIZE``), so the next checkpoint write
                   fails with the OS error a full disk gives.
"""
import os
import os.path as osp
import resource
import signal
import time

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

#: longer than any test waits: the test kills the process first
PAUSE_S = 600.0
PAUSED_FILE = 'paused'
KILLED_FILE = 'killed_at'


def _pause(work_dir: str, what: str) -> None:
    with open(osp.join(work_dir, PAUSED_FILE), 'w') as f:
        f.write(what)
    time.sleep(PAUSE_S)


@HOOKS.register_module()
class CrashPointHook(Hook):
    """Arms the pause (or the file size limit) named by ``CRASH_AT`` at its iteration."""
    priority = 'VERY_HIGH'

    def __init__(self) -> None:
        spec = os.environ.get('CRASH_AT', '')
        point, _, it = spec.partition(':')
        self.point = point
        self.iteration = int(it) if it else -1

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if runner.iter + 1 != self.iteration:
            return
        work_dir = runner.work_dir
        if self.point == 'sigkill':
            if os.environ.get('CRASH_RANK', str(runner.rank)) == str(runner.rank):
                with open(osp.join(work_dir, KILLED_FILE), 'w') as f:
                    f.write(repr(time.time()))  # when, for the test's exit-time bound
                os.kill(os.getpid(), signal.SIGKILL)
        elif self.point == 'forward':
            model = runner.model

            def pause_in_forward(module, args):
                _pause(work_dir, f'forward of iteration {runner.iter + 1}')
            model.backbone.register_forward_pre_hook(pause_in_forward)
        elif self.point == 'write':
            from mmengine.fileio.backends.local_backend import LocalBackend
            real_put = LocalBackend.put

            def half_put(backend, obj, filepath):
                if osp.basename(str(filepath)).startswith(f'iter_{self.iteration}.pth'):
                    with open(filepath, 'wb') as f:
                        f.write(obj[:len(obj) // 2])
                        f.flush()
                        os.fsync(f.fileno())
                    _pause(work_dir, f'writing {filepath}')
                return real_put(backend, obj, filepath)
            LocalBackend.put = half_put
        elif self.point == 'pointer':
            from vitdet_plugin.engine import checkpoint as ckpt_module
            real_write = ckpt_module.atomic_write_text

            def pause_before_pointer(path, text):
                if text.endswith(f'iter_{self.iteration}.pth'):
                    _pause(work_dir, f'before pointing last_checkpoint at {text}')
                return real_write(path, text)
            ckpt_module.atomic_write_text = pause_before_pointer
        elif self.point == 'disk_full':
            limit = int(os.environ['CRASH_FILE_LIMIT'])
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
