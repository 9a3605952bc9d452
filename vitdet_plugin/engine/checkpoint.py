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

:func:`install_safe_checkpoint_loader` (applied on import, for every OpenMMLab library in the
process) makes mmengine's loaders for local files and for URLs (``http(s)://``, and through it
``modelzoo://``, ``torchvision://``, ``open-mmlab://``, ``mmcls://``), used by ``Runner.resume``
(``tools/train.py --resume``), ``load_from`` and ``load_checkpoint``, read with an explicit
``torch.load(weights_only=True)`` and refuse a checkpoint carrying arbitrary Python objects with
a :class:`CheckpointError` that names the file, the refused object and the way to trust it
(nothing is executed). mmengine's own URL loader goes through torch hub's
``load_state_dict_from_url``, which unpickles anything. A file you trust (e.g. a training
checkpoint holding an ``argparse.Namespace``) is read with full unpickling only when its path
or URL is listed in the environment variable ``VITDET_TRUSTED_CHECKPOINTS`` (``os.pathsep``
separated); there is no switch that turns safe loading off for all files. Only unpickling and
file-format errors become "cannot read" errors; out-of-memory or device errors propagate.
"""
import logging
import os
import os.path as osp
import pickle
import re
from collections import deque
from typing import Any, Deque, List, Optional

import mmengine.runner.checkpoint as mmengine_checkpoint
import torch.distributed
from mmengine.dist import get_dist_info, is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.logging import print_log
from mmengine.registry import HOOKS
from mmengine.runner.checkpoint import CheckpointLoader

from ..weights.common import CheckpointError, resolve_checkpoint_path

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
        except BaseException:
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
            raise

        # From here on the new checkpoint is complete; publish it, then retire old ones.
        if not is_main_process():
            return
        atomic_replace(tmp_path, final_path)
        atomic_write_text(osp.join(runner.work_dir, LAST_CHECKPOINT_FILE), final_path)
        if stale is not None and stale != step:
            old = osp.join(self.out_dir, self.filename_tmpl.format(stale))
            if osp.isfile(old):
                os.remove(old)


# ----------------------------------------------------------------------------- safe loading
#: environment variable listing checkpoints (paths or URLs, separated by os.pathsep) that may be
#: read with full unpickling; nothing else is ever read that way
TRUST_ENV = 'VITDET_TRUSTED_CHECKPOINTS'
#: what torch.load raises (besides pickle.UnpicklingError) for a file that is no checkpoint:
#: EOFError for an empty file, KeyError from the legacy-format reader on arbitrary bytes (a
#: memo lookup of a byte that happens to be a pickle GET opcode)
_FORMAT_ERRORS = (EOFError, KeyError)
#: RuntimeErrors of torch's readers for a truncated / non-zip file or a plain pickle; other
#: RuntimeErrors (CUDA out of memory, a map_location naming a missing device) propagate
_FORMAT_RUNTIME_ERRORS = ('PytorchStreamReader', 'Invalid magic number')
#: how torch's weights_only unpickler names a refused object, and where it gives its reason
_GLOBAL_RE = re.compile(r'GLOBAL ([\w.]+)')
_UNPICKLER_MARK = 'WeightsUnpickler error:'


def trusted_checkpoints() -> List[str]:
    """The entries of :data:`TRUST_ENV` (``~`` expanded, local paths made absolute)."""
    entries = [e.strip() for e in os.environ.get(TRUST_ENV, '').split(os.pathsep)]
    return [e if '://' in e else osp.realpath(osp.expanduser(e)) for e in entries if e]


def is_trusted(*names: str) -> bool:
    """Whether any of ``names`` (the path or URL given, the local file read) is listed in
    :data:`TRUST_ENV`."""
    trusted = trusted_checkpoints()
    return any((n if '://' in n else osp.realpath(osp.expanduser(n))) in trusted
               for n in names if n)


def _refused_global(error: pickle.UnpicklingError) -> Optional[str]:
    """The ``module.name`` torch's weights_only unpickler refused, if that was the error."""
    found = _GLOBAL_RE.search(str(error))
    return found.group(1) if found else None


def _unpickler_detail(error: pickle.UnpicklingError) -> str:
    """torch's own reason (the line after 'WeightsUnpickler error:'), else the first line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.endswith(_UNPICKLER_MARK) and i + 1 < len(lines):
            return lines[i + 1]
    return lines[0] if lines else ''


def load_trusted_or_weights_only(path: str, map_location: Any = None,
                                 given: Optional[str] = None) -> Any:
    """Read the ``torch.save`` file ``path`` (``given``: the name the user wrote, e.g. a URL).

    ``weights_only=True`` unless ``path`` or ``given`` is listed in :data:`TRUST_ENV`. A
    refused object raises :class:`CheckpointError` naming it and the way to trust the file;
    a file that is no checkpoint raises :class:`CheckpointError` saying so; every other error
    (out of memory, a device ``map_location`` cannot reach) propagates unchanged.
    """
    if is_trusted(path, given or ''):
        print_log(f'{TRUST_ENV} lists {given or path!r}: reading it with full unpickling '
                  '(weights_only=False)', logger='current', level=logging.WARNING)
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(e)
        if refused is None:
            raise _not_a_checkpoint(path, e, _unpickler_detail(e)) from e
        raise CheckpointError(
            f'refused to load checkpoint {path!r}: it contains Python objects that are not on '
            f'the weights_only allow-list (refused: {refused}); unpickling it could run '
            f'arbitrary code, so nothing was loaded or executed. If you trust this file, '
            f'list it in the environment variable {TRUST_ENV} (e.g. '
            f'{TRUST_ENV}={given or path}; several files separated by {os.pathsep!r}) and '
            f'it is read with full unpickling; or re-save it as tensors and plain '
            f'containers.') from e
    except _FORMAT_ERRORS as e:
        raise _not_a_checkpoint(path, e) from e
    except RuntimeError as e:
        if not any(marker in str(e) for marker in _FORMAT_RUNTIME_ERRORS):
            raise
        raise _not_a_checkpoint(path, e) from e


def _not_a_checkpoint(path: str, error: BaseException,
                      detail: Optional[str] = None) -> CheckpointError:
    first = detail if detail is not None else (str(error).strip().splitlines() or [''])[0]
    return CheckpointError(f'cannot read {path!r} as a checkpoint ({type(error).__name__}: '
                           f'{first}): the file is truncated or not written by torch.save; '
                           'save or download it again')


def safe_load_from_local(filename: str, map_location: Any = None) -> Any:
    """mmengine's local-file checkpoint loader, through :func:`load_trusted_or_weights_only`."""
    path = resolve_checkpoint_path(filename, source='--resume / load_from / the checkpoint path')
    return load_trusted_or_weights_only(path, map_location, filename)


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
    assert path is not None  # every rank resolved it
    return load_trusted_or_weights_only(path, map_location, filename)


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
