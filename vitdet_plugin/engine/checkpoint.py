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
Remote backends (``backend_args`` / ``out_dir`` URIs) fall back to the stock behaviour.

:func:`install_safe_checkpoint_loader` (applied on import) makes mmengine's loaders for local
files and for URLs (``http(s)://``, and through it ``modelzoo://``, ``torchvision://``,
``open-mmlab://``, ``mmcls://``), used by ``Runner.resume`` (``tools/train.py --resume``),
``load_from`` and ``load_checkpoint``, read with an explicit ``torch.load(weights_only=True)``
and refuse a checkpoint carrying arbitrary Python objects with a :class:`CheckpointError` that
names the file and the refused object (nothing is executed). mmengine's own URL loader goes
through torch hub's ``load_state_dict_from_url``, which unpickles anything.
"""
import os
import os.path as osp
from typing import Any, Optional

import mmengine.runner.checkpoint as mmengine_checkpoint
import torch.distributed
from mmengine.dist import get_dist_info, is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.registry import HOOKS
from mmengine.runner.checkpoint import CheckpointLoader

from ..weights.common import resolve_checkpoint_path, torch_load_weights_only

#: suffix of the partial file a save writes before the atomic rename
TMP_SUFFIX = '.tmp'
LAST_CHECKPOINT_FILE = 'last_checkpoint'


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
    """Sync ``tmp_path`` to disk and rename it over ``path`` in one atomic step."""
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
        except BaseException:
            if is_main_process():
                remove_if_exists(tmp_path)  # never leave a partial file behind
            raise

        # From here on the new checkpoint is complete; publish it, then retire old ones.
        self.last_ckpt = final_path
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)
        stale: Optional[int] = None
        if self.max_keep_ckpts > 0 and not (self.keep_ckpt_ids
                                            and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == self.max_keep_ckpts:  # a bounded deque
                stale = self.keep_ckpt_ids.popleft()
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))

        if not is_main_process():
            return
        atomic_replace(tmp_path, final_path)
        atomic_write_text(osp.join(runner.work_dir, LAST_CHECKPOINT_FILE), final_path)
        if stale is not None and stale != step:
            old = osp.join(self.out_dir, self.filename_tmpl.format(stale))
            if osp.isfile(old):
                os.remove(old)


# ----------------------------------------------------------------------------- safe loading
def safe_load_from_local(filename: str, map_location: Any = None) -> Any:
    """mmengine's local-file checkpoint loader with ``weights_only=True`` and clear errors."""
    path = resolve_checkpoint_path(filename, source='--resume / load_from / the checkpoint path')
    return torch_load_weights_only(path, map_location)


def safe_load_from_http(filename: str, map_location: Any = None,
                        model_dir: Optional[str] = None, progress: bool = False) -> Any:
    """mmengine's URL checkpoint loader (same signature) with ``weights_only=True``.

    As mmengine does, rank 0 downloads first (into ``model_dir``, default torch hub's
    checkpoint cache) while the other ranks wait, then read the cached file."""
    del progress  # downloads are quiet, as in weights.common
    rank, world_size = get_dist_info()
    path = resolve_checkpoint_path(filename, model_dir) if rank == 0 else None
    if world_size > 1:
        torch.distributed.barrier()
        if rank > 0:
            path = resolve_checkpoint_path(filename, model_dir)
    return torch_load_weights_only(path, map_location)


def install_safe_checkpoint_loader() -> None:
    """Route mmengine's loading of local checkpoint files and URLs through
    :func:`safe_load_from_local` / :func:`safe_load_from_http` (idempotent)."""
    CheckpointLoader.register_scheme(prefixes='', force=True)(safe_load_from_local)
    CheckpointLoader.register_scheme(prefixes=('http://', 'https://'),
                                     force=True)(safe_load_from_http)
    # modelzoo://, torchvision://, open-mmlab:// and mmcls:// resolve to a URL and call the
    # module-level load_from_http directly, not through the registry
    mmengine_checkpoint.load_from_http = safe_load_from_http


install_safe_checkpoint_loader()
