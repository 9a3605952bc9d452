"""Exact resume, RNG states in checkpoints, crash-safe checkpoint writes, safe resume loading."""
import os
import os.path as osp

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from mmengine.hooks import Hook
from mmengine.runner import Runner

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine.hooks import RNG_STATE_KEY, get_rng_state, set_rng_state
from vitdet_plugin.weights.checkpoint_io import CheckpointError

N_ITERS, K_ITERS = 6, 3


class LossRecorder(Hook):
    """Records the losses of every training iteration; optionally stops after ``stop_at``."""
    priority = 'LOWEST'

    def __init__(self, stop_at: int = 0) -> None:
        self.losses = {}
        self.stop_at = stop_at

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.losses[runner.iter + 1] = {k: float(v.detach()) for k, v in outputs.items()}
        if runner.iter + 1 == self.stop_at:
            runner.train_loop.stop_training = True


def _train(data_root, work_dir, name, stop_at=0, resume=False, **kw):
    rec = LossRecorder(stop_at)
    torch.set_num_threads(1)
    runner = Runner(**tiny_cfg(data_root, work_dir, max_iters=N_ITERS, ckpt_interval=K_ITERS,
                               name=name, custom_hooks=[rec], resume=resume, **kw))
    runner.train()
    return rec.losses, runner.model.state_dict()


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('shapes')))


def test_rng_state_roundtrip_is_weights_only_loadable(tmp_path):
    import random

    import numpy as np
    state = get_rng_state()
    path = tmp_path / 'rng.pt'
    torch.save({RNG_STATE_KEY: state}, path)
    ref = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    set_rng_state(torch.load(path, weights_only=True)[RNG_STATE_KEY])
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == ref


@pytest.mark.parametrize('numpy_module', ['numpy._core', 'numpy.core'], ids=['numpy2', 'numpy1'])
def test_checkpoint_written_by_either_numpy_loads_weights_only(tmp_path, numpy_module):
    """A message hub pickled by numpy 1.x names ``numpy.core.multiarray``, one pickled by
    numpy 2 ``numpy._core.multiarray``: both load with weights_only, whichever is installed."""
    import zipfile

    from mmengine.logging import MessageHub

    from vitdet_plugin.compat import safe_load_from_local
    hub = MessageHub.get_instance('numpy-names')
    hub.update_scalar('train/loss', 1.5)
    written = tmp_path / 'written.pth'
    torch.save({'state_dict': {'w': torch.ones(1)}, 'message_hub': hub.state_dict()}, written)
    path = tmp_path / 'ckpt.pth'
    with zipfile.ZipFile(written) as src, zipfile.ZipFile(path, 'w') as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith('data.pkl'):  # the module names as that numpy writes them
                data = data.replace(b'numpy._core.multiarray\n', b'numpy.core.multiarray\n')
                data = data.replace(b'numpy.core.multiarray\n',
                                    numpy_module.encode() + b'.multiarray\n')
            dst.writestr(item, data)
    assert (numpy_module + '.multiarray').encode() in zipfile.ZipFile(path).read(
        next(n for n in zipfile.ZipFile(path).namelist() if n.endswith('data.pkl')))
    ckpt = safe_load_from_local(str(path))
    restored = MessageHub.get_instance('numpy-names-restored')
    restored.load_state_dict(ckpt['message_hub'])
    assert restored.get_scalar('train/loss').current() == 1.5


def test_exact_resume_matches_uninterrupted_run(data_root, tmp_path):
    full_losses, full_state = _train(data_root, str(tmp_path / 'full'), 'full')
    assert sorted(full_losses) == list(range(1, N_ITERS + 1))

    work = str(tmp_path / 'interrupted')
    first, _ = _train(data_root, work, 'first', stop_at=K_ITERS)
    assert sorted(first) == list(range(1, K_ITERS + 1))
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, f'iter_{K_ITERS}.pth')
    ckpt = torch.load(osp.join(work, f'iter_{K_ITERS}.pth'), weights_only=True)
    assert {'state_dict', 'optimizer', 'param_schedulers', 'message_hub',
            RNG_STATE_KEY} <= set(ckpt)

    resumed, resumed_state = _train(data_root, work, 'resumed', resume=True)
    assert sorted(resumed) == list(range(K_ITERS + 1, N_ITERS + 1))
    for it in range(1, K_ITERS + 1):
        assert first[it] == full_losses[it], f'iteration {it} differs before the interruption'
    for it in range(K_ITERS + 1, N_ITERS + 1):
        for key, ref in full_losses[it].items():
            assert resumed[it][key] == pytest.approx(ref, rel=1e-6, abs=1e-7), \
                f'iteration {it} {key}: resumed {resumed[it][key]} vs uninterrupted {ref}'
    for key, ref in full_state.items():
        torch.testing.assert_close(resumed_state[key], ref, rtol=1e-6, atol=1e-7, msg=key)


def _partial_torch_save(real_save):
    def save(obj, f, *args, **kwargs):
        import io
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])  # half the bytes reach the target, then the crash
        raise KeyboardInterrupt('simulated kill during torch.save')
    return save


def _partial_put(real_put):
    def put(self, obj, filepath):
        with open(filepath, 'wb') as f:
            f.write(obj[:len(obj) // 2])
        raise OSError(28, 'No space left on device (simulated)')
    return put


@pytest.mark.parametrize('crash', ['torch.save', 'file write'])
def test_crash_mid_save_keeps_previous_checkpoint(data_root, tmp_path, monkeypatch, crash):
    from mmengine.fileio.backends import LocalBackend

    work = str(tmp_path / 'crash')
    calls = {'n': 0}
    real_save, real_put = torch.save, LocalBackend.put

    class CrashOnSecondSave(Hook):
        priority = 'VERY_HIGH'

        def before_save_checkpoint(self, runner, checkpoint):
            calls['n'] += 1
            if calls['n'] == 2:  # the save at iteration 2 * K_ITERS crashes
                if crash == 'torch.save':
                    monkeypatch.setattr(torch, 'save', _partial_torch_save(real_save))
                else:
                    monkeypatch.setattr(LocalBackend, 'put', _partial_put(real_put))

    torch.set_num_threads(1)
    runner = Runner(**tiny_cfg(data_root, work, max_iters=N_ITERS, ckpt_interval=K_ITERS,
                               name=f'crash-{crash}', custom_hooks=[CrashOnSecondSave()]))
    with pytest.raises((KeyboardInterrupt, OSError), match='simulated') as e:
        runner.train()
    monkeypatch.undo()

    prev = osp.join(work, f'iter_{K_ITERS}.pth')
    if crash == 'file write':  # a full disk: reported, naming both files and what to do
        from vitdet_plugin.engine.checkpoint import CheckpointSaveError
        assert isinstance(e.value, CheckpointSaveError) and e.value.errno == 28
        assert str(e.value) == (
            f'saving checkpoint {osp.join(work, f"iter_{2 * K_ITERS}.pth")} failed: OSError: '
            '[Errno 28] No space left on device (simulated); nothing was written over older '
            f'files (the previous checkpoint {prev} is complete and last_checkpoint still '
            'points at it). Free disk space (or raise the quota / file size limit) and '
            'continue with tools/train.py CONFIG --resume')
    assert sorted(f for f in os.listdir(work) if f.endswith(('.pth', '.tmp'))) == \
        [f'iter_{K_ITERS}.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == prev
    ckpt = torch.load(prev, weights_only=True)
    assert ckpt['meta']['iter'] == K_ITERS and RNG_STATE_KEY in ckpt


def test_max_keep_ckpts_removes_old_checkpoint_only_after_new_one(data_root, tmp_path):
    work = str(tmp_path / 'keep')
    _train(data_root, work, 'keep')
    assert sorted(f for f in os.listdir(work) if f.endswith(('.pth', '.tmp'))) == \
        [f'iter_{N_ITERS}.pth']


def test_resume_then_max_keep_ckpts_1_leaves_one_checkpoint(data_root, tmp_path):
    """Train to K_ITERS (checkpoint), resume, train to N_ITERS: with max_keep_ckpts=1 the
    checkpoint resumed from is retired like any other; one checkpoint is left."""
    work = str(tmp_path / 'keep-resume')
    _train(data_root, work, 'keep-first', stop_at=K_ITERS)
    assert sorted(f for f in os.listdir(work) if f.endswith('.pth')) == [f'iter_{K_ITERS}.pth']
    ckpt = torch.load(osp.join(work, f'iter_{K_ITERS}.pth'), weights_only=True)
    info = ckpt['message_hub']['runtime_info']
    assert info['keep_ckpt_ids'] == [K_ITERS]  # recorded before the save, as mmengine does
    assert info['last_ckpt'] == osp.join(work, f'iter_{K_ITERS}.pth')
    _train(data_root, work, 'keep-resumed', resume=True)
    assert sorted(f for f in os.listdir(work) if f.endswith(('.pth', '.tmp'))) == \
        [f'iter_{N_ITERS}.pth']


class _Payload:
    """Unpickling this would run ``os.system`` (creating a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def test_resume_refuses_malicious_checkpoint(data_root, tmp_path):
    """``tools/train.py --resume`` goes through ``Runner.resume``: torch's weights_only load
    must refuse a pickle that runs code, naming the offending global; nothing is executed."""
    from mmengine.runner.checkpoint import load_checkpoint

    marker = tmp_path / 'pwned'
    ckpt = tmp_path / 'evil.pth'
    torch.save(dict(meta=dict(iter=1), state_dict={}, evil=_Payload(str(marker))), ckpt)

    match = (r"refused to load checkpoint '.*evil\.pth': it contains Python objects that are "
             r'not on the weights_only allow-list \(refused: posix\.system\)')
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(torch.nn.Linear(1, 1), str(ckpt))
    torch.set_num_threads(1)
    runner = Runner(**tiny_cfg(data_root, str(tmp_path / 'w'), name='evil'))
    with pytest.raises(CheckpointError, match=match):
        runner.resume(str(ckpt))
    with pytest.raises(FileNotFoundError, match=r"checkpoint file '/no/such\.pth' does not "
                                                r'exist; check --resume / load_from'):
        runner.resume('/no/such.pth')
    assert not marker.exists()


def test_load_from_url_refuses_malicious_checkpoint(tmp_path, monkeypatch):
    """``load_from='https://...'`` (stock mmdet fine-tuning configs) and the URL schemes that
    resolve to one: mmengine reads them through torch hub, which unpickles anything; ours
    downloads into the hub cache and reads with weights_only."""
    import shutil

    import mmengine.runner.checkpoint as mmengine_checkpoint
    from mmengine.runner.checkpoint import load_checkpoint

    from vitdet_plugin.compat import safe_load_from_http

    served = tmp_path / 'served'
    served.mkdir()
    marker = tmp_path / 'pwned'
    torch.save(dict(state_dict={}, evil=_Payload(str(marker))), served / 'evil.pth')
    good = torch.nn.Linear(2, 3)
    torch.save(dict(state_dict=good.state_dict()), served / 'good.pth')
    monkeypatch.setattr(torch.hub, 'download_url_to_file',
                        lambda url, dst, **kw: shutil.copy(served / url.rsplit('/', 1)[1], dst))
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))

    with pytest.raises(CheckpointError, match=r"refused to load checkpoint .*evil\.pth.*"
                                              r'posix\.system'):
        load_checkpoint(torch.nn.Linear(2, 3), 'https://example.com/ckpts/evil.pth')
    assert not marker.exists()
    model = torch.nn.Linear(2, 3)
    load_checkpoint(model, 'https://example.com/ckpts/good.pth')
    assert torch.equal(model.weight, good.weight)
    assert (tmp_path / 'torch' / 'hub' / 'checkpoints' / 'good.pth').is_file()
    # modelzoo:// / torchvision:// / open-mmlab:// call the module-level loader directly
    assert mmengine_checkpoint.load_from_http is safe_load_from_http


def test_resume_checkpoint_loads_in_a_fresh_process(data_root, tmp_path, monkeypatch):
    """``tools/test.py CKPT`` / ``--resume`` in a new process: no ``HistoryBuffer`` has been
    created yet, so its class-level ``_statistics_methods`` registry is still empty; the
    weights_only allow-list must still accept the statistics methods mmengine pickles."""
    from mmengine.logging import HistoryBuffer
    work = str(tmp_path / 'fresh')
    _train(data_root, work, 'fresh', stop_at=K_ITERS)
    monkeypatch.setattr(HistoryBuffer, '_statistics_methods', {})  # as in a fresh process
    ckpt = torch.load(osp.join(work, f'iter_{K_ITERS}.pth'), weights_only=True)
    assert ckpt['meta']['iter'] == K_ITERS
