"""Crash-safe checkpoint saving.

mmengine's ``CheckpointHook`` writes ``iter_N.pth`` and ``last_checkpoint`` in place and, with
``max_keep_ckpts``, deletes the oldest checkpoint *before* writing the new one: a run killed
while saving (pre-emption, OOM killer, full disk) can leave a truncated newest file, a
``last_checkpoint`` pointing at nothing or, with ``max_keep_ckpts=1``, no checkpoint at all.

:class:`AtomicCheckpointHook` (registered in mmengine's ``HOOKS``) keeps every option of
``CheckpointHook`` but, for local work dirs, writes ``<file>.tmp``, syncs it and renames it over
``<file>`` (:func:`os.replace` is atomic on POSIX and Windows), then updates ``last_checkpoint``
the same way, and only then removes checkpoints beyond ``max_keep_ckpts``. At every instant the
previous checkpoint and the ``last_checkpoint`` pointing at it stay complete and loadable.
A DCP checkpoint (``FSDP2Runner``) is a directory: it is renamed and removed the same way.
Remote backends (``backend_args`` / ``out_dir`` URIs) fall back to the stock behaviour.

Reading checkpoints (safe loading, the trust list, mmengine's loaders) is
:mod:`vitdet_plugin.weights.checkpoint_io`.
"""
import os
import os.path as osp
import shutil
from collections import deque
from typing import Deque, Optional

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.registry import HOOKS

#: suffix of the partial file a save writes before the atomic rename
TMP_SUFFIX = '.tmp'
LAST_CHECKPOINT_FILE = 'last_checkpoint'


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (full disk, quota, file size limit, permissions); the
    previous checkpoint and ``last_checkpoint`` are untouched."""


def _save_failed_message(path: str, error: OSError, previous: Optional[str]) -> str:
    kept = (f'the previous checkpoint {previous} is complete and last_checkpoint still points '
            'at it' if previous else 'no earlier checkpoint of this run exists')
    return (f'saving checkpoint {path} failed: {type(error).__name__}: {error}; nothing was '
            f'written over older files ({kept}). Free disk space (or raise the quota / file '
            'size limit) and continue with tools/train.py CONFIG --resume')


def _fsync_file(path: str) -> None:
    with open(path, 'rb+') as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:  # persist the rename itself; not possible on every platform/filesystem
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_replace(tmp_path: str, path: str) -> None:
    """Sync ``tmp_path`` to disk and rename it over ``path`` in one atomic step. A directory
    (a DCP checkpoint, its files synced by DCP) replaces an older one of the same name, which
    is removed first."""
    if osp.isdir(tmp_path):
        if osp.isdir(path):
            shutil.rmtree(path)
    else:
        _fsync_file(tmp_path)
    os.replace(tmp_path, path)
    _fsync_dir(osp.dirname(osp.abspath(path)))


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so readers see either the old or the new content."""
    tmp = path + TMP_SUFFIX
    with open(tmp, 'w') as f:
        f.write(text)
    atomic_replace(tmp, path)


def remove_if_exists(path: str) -> None:
    """Remove the file, or the directory (a DCP checkpoint), ``path`` if it exists."""
    if osp.isdir(path):
        shutil.rmtree(path)
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


@HOOKS.register_module()
class AtomicCheckpointHook(CheckpointHook):
    """``CheckpointHook`` whose saves cannot leave a corrupt or missing latest checkpoint.

    Drop-in replacement: ``default_hooks = dict(checkpoint=dict(type='AtomicCheckpointHook',
    interval=..., by_epoch=..., max_keep_ckpts=...))``; every ``CheckpointHook`` argument works
    unchanged. See the module docstring for the write protocol.
    """

    def _is_local(self, runner) -> bool:
        out_dir = self.out_dir if isinstance(self.out_dir, str) else runner.work_dir
        return self.backend_args is None and self.file_client_args is None \
            and '://' not in out_dir

    def _save_checkpoint_with_step(self, runner, step: int, meta: dict) -> None:
        if not self._is_local(runner):
            return super()._save_checkpoint_with_step(runner, step, meta)

        ckpt_filename = self.filename_tmpl.format(step)
        final_path = osp.join(self.out_dir, ckpt_filename)
        tmp_path = final_path + TMP_SUFFIX
        # As mmengine's CheckpointHook does, the message hub gets the keep-list (with this
        # step) and last_ckpt *before* the save, so the checkpoint records them and a resumed
        # run retires the checkpoint it resumed from; the files are only removed afterwards.
        hub = runner.message_hub
        saved_info = {k: hub.runtime_info[k] for k in ('keep_ckpt_ids', 'last_ckpt')
                      if k in hub.runtime_info}
        # set by CheckpointHook.before_train when max_keep_ckpts > 0
        keep: Optional[Deque[int]] = getattr(self, 'keep_ckpt_ids', None)
        saved_keep = None if keep is None else deque(keep, keep.maxlen)
        saved_last: Optional[str] = getattr(self, 'last_ckpt', None)
        stale: Optional[int] = None
        if keep is not None and self.max_keep_ckpts > 0 and not (keep and keep[-1] == step):
            if len(keep) == self.max_keep_ckpts:  # a bounded deque
                stale = keep.popleft()
            keep.append(step)
            hub.update_info('keep_ckpt_ids', list(keep))
        self.last_ckpt = final_path
        hub.update_info('last_ckpt', self.last_ckpt)
        try:
            runner.save_checkpoint(
                self.out_dir,
                ckpt_filename + TMP_SUFFIX,
                self.file_client_args,
                save_optimizer=self.save_optimizer,
                save_param_scheduler=self.save_param_scheduler,
                meta=meta,
                by_epoch=self.by_epoch,
                backend_args=self.backend_args,
                **self.args)
        except BaseException as e:
            if is_main_process():
                remove_if_exists(tmp_path)  # never leave a partial file behind
            self.last_ckpt = saved_last  # nothing was saved: the state before it stands
            if saved_keep is not None:
                self.keep_ckpt_ids = saved_keep
            for key in ('keep_ckpt_ids', 'last_ckpt'):
                if key in saved_info:
                    hub.update_info(key, saved_info[key])
                else:
                    hub.pop_info(key)
            if isinstance(e, OSError) and not isinstance(e, CheckpointSaveError):
                error = CheckpointSaveError(_save_failed_message(final_path, e, saved_last))
                error.errno = e.errno
                raise error from e
            raise

        # From here on the new checkpoint is complete; publish it, then retire old ones.
        if not is_main_process():
            return
        atomic_replace(tmp_path, final_path)
        atomic_write_text(osp.join(runner.work_dir, LAST_CHECKPOINT_FILE), final_path)
        if stale is not None and stale != step:
            remove_if_exists(osp.join(self.out_dir, self.filename_tmpl.format(stale)))
