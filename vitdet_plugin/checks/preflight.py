"""Everything checked before a run builds its model: :func:`preflight` for our tools and
scripts, :class:`PreflightCheckHook` for any mmengine runner (mmdet's own ``tools/train.py``,
``mim train``).

One pass, one report: the dataset files exist (:func:`vitdet_plugin.config.check_data`, with
the file or folder a missing path most likely means, :mod:`.suggest`), the config's pieces fit
together and with the data's classes (:func:`.config.config_problems`), the annotations are
usable (:func:`.data.check_annotations`, which also gives the summary lines printed at start),
the batch fits the dataset and the pretrained weights can be had
(:func:`.init_sources.unreachable_weights`). The report ends with every fix as
``--cfg-options``. The summary also says where each model part's weights come from, and
:class:`PreflightCheckHook` says it again once they are loaded.
"""
import copy
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..config import DatasetNotFoundError, check_data, running_tool
from ..datasets.data_folder import DataFolderError, find_data_folder
from .config import (ConfigCheckError, FeatureMaps, config_problems, leftover_deletes,
                     probe_backbone, raise_problems, without_deletes)
from .data import DataCheckError, DataSummary, check_annotations
from .init_sources import loaded_init_lines, planned_init_lines, unreachable_weights
from .suggest import (class_suggestions, file_suggestions, merge_fixes, options_text,
                      set_fixes, with_file_lines)

#: type name of the hook, as configs write it
HOOK_TYPE = 'PreflightCheckHook'


def folder_layout(root: Any) -> Optional[str]:
    """The layout of ``root`` when ``--data`` reads it as a data folder
    (:func:`~vitdet_plugin.datasets.data_folder.find_data_folder`), else None."""
    if not isinstance(root, str) or not os.path.isdir(root):
        return None
    try:
        return find_data_folder(root).layout
    except DataFolderError:
        return None


def batch_problems(cfg: Any, summaries: Sequence[DataSummary]) -> List[str]:
    """``train_dataloader.batch_size`` larger than the images training can draw from."""
    loader = cfg.get('train_dataloader') or {}
    batch = loader.get('batch_size')
    dataset = loader.get('dataset') or {}
    usable = [s for s in summaries if s.key.startswith('train_dataloader.')]
    # only a dataset used as it is: wrappers (repeat, concat, mosaic) change the count
    if not isinstance(batch, int) or len(usable) != 1 or 'ann_file' not in dataset:
        return []
    kept = usable[0].kept_images
    if batch <= kept:
        return []
    return [f'train_dataloader.batch_size={batch} is larger than {usable[0].key} ({kept} '
            f'images to train on in {usable[0].ann_file}); set train_dataloader.batch_size='
            f'{max(kept, 1)} or fewer, or give the dataset more images']


class PreflightError(DatasetNotFoundError, ConfigCheckError, DataCheckError):
    """Problems of several kinds (data files, config, annotations) found in one pass; it is each
    of the single-kind errors, so code catching one of them catches it too."""


def _checked_copy(cfg: Any, fixes: Dict[str, Any]) -> Any:
    """``cfg`` with ``fixes`` applied and no leftover ``_delete_`` (a copy; ``cfg`` itself is
    left as the user wrote it)."""
    if not fixes:
        return without_deletes(cfg)
    fixed = copy.deepcopy(cfg)
    merge_fixes(fixed, fixes)
    return without_deletes(fixed)


def _problem_block(problems: Sequence[str], cfg: Any, config_path: Optional[str]) -> str:
    try:
        raise_problems(problems, cfg, config_path)
    except ConfigCheckError as e:
        return str(e)
    return ''


def preflight(cfg: Any, stages: Sequence[str] = ('train', 'val'),
              config_path: Optional[str] = None, tool: str = 'tools/train.py',
              weights: bool = True,
              log: Optional[Callable[[str], None]] = print,
              ours: bool = True) -> List[DataSummary]:
    """Check ``cfg`` for a run over ``stages`` before anything is built, every problem in one
    report.

    The data files, the config's pieces, the annotations, the batch size and (``weights``) the
    checkpoints training loads are all checked in the same pass. A missing annotation file or
    image folder that one file / folder in the expected place fits, and a ``metainfo.classes``
    left unset while the annotations have other categories, are assumed fixed
    (:mod:`.suggest`) for the checks after them, so the class counts are checked against the
    data's classes in the same report; the report ends with every fix as ``--cfg-options``.
    ``tool`` is the script the messages name (``ours``: one of vitdet_plugin's tools, which
    move every path derived from ``data_root``).

    Raises :class:`~vitdet_plugin.datasets.DatasetNotFoundError`,
    :class:`~.config.ConfigCheckError` or :class:`~.data.DataCheckError` when the problems are
    of one kind, :class:`PreflightError` (all three) when of several; on success ``log`` gets
    one summary line per dataset (images, boxes, dropped) and one per model part (where its
    weights come from), and the summaries are returned.
    """
    from mmengine.registry import init_default_scope
    init_default_scope(cfg.get('default_scope') or 'mmdet')
    sections: List[Tuple[type, str]] = []
    fixes: Dict[str, Any] = {}
    try:
        check_data(cfg, stages, config_path=config_path, tool=tool, ours=ours,
                   root_layout=folder_layout(cfg.get('data_root')))
    except DatasetNotFoundError as e:
        found = file_suggestions(cfg, stages)
        sections.append((DatasetNotFoundError, with_file_lines(str(e), found)))
        fixes.update(found)
    classes, class_lines = class_suggestions(_checked_copy(cfg, fixes), stages)
    fixes.update(classes)
    checked = _checked_copy(cfg, fixes)
    model = checked.get('model')
    probed = probe_backbone(model) if isinstance(model, dict) else None  # built once, on meta
    problems = leftover_deletes(cfg) + class_lines
    problems += config_problems(checked, stages, weights, probed)
    if weights:
        problems += unreachable_weights(checked)
    largest = max(probed.strides) if isinstance(probed, FeatureMaps) else None
    summaries: List[DataSummary] = []
    data_text = ''
    try:
        summaries = check_annotations(checked, stages, min_image_side=largest)
    except DataCheckError as e:
        data_text = str(e)
    if 'train' in stages:
        problems += batch_problems(checked, summaries)
    fixes.update(set_fixes(problems))
    if problems:
        sections.append((ConfigCheckError, _problem_block(problems, cfg, config_path)))
    if data_text:
        sections.append((DataCheckError, data_text))
    if sections:
        tail = options_text(fixes)
        if len(sections) == 1:
            kind, text = sections[0]
            raise kind('\n'.join([text, *tail]))
        name = config_path or getattr(cfg, 'filename', None) or 'the config'
        head = (f'{name}: {len(sections)} kinds of problem found before training (data files, '
                'config, annotations: all of them, in one report)')
        raise PreflightError('\n\n'.join([head, *(t for _, t in sections)]
                                          + (['\n'.join(tail)] if tail else [])))
    if log is not None:
        for s in summaries:
            log(s.line())
        for line in planned_init_lines(cfg) if 'train' in stages else ():
            log(line)
    return summaries


def report_rank() -> int:
    """This process's rank in a job (torchrun's ``RANK``; the process group's once started):
    a report every rank would print identically is printed by rank 0 only."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get('RANK', '0') or 0)


def exit_on_report(error: Exception) -> NoReturn:
    """End a tool whose checks failed: rank 0 exits with ``error: <the report>``, the other
    ranks of a job with status 1 and no text (one report per job)."""
    if report_rank() != 0:
        sys.exit(1)
    sys.exit(f'error: {error}')


def drop_preflight_hook(cfg: Any) -> None:
    """Turn off the checks of :class:`PreflightCheckHook` in ``cfg.custom_hooks`` (for tools that
    ran :func:`preflight` themselves, before the datasets were built); the hook still logs where
    each model part's weights came from."""
    hooks = cfg.get('custom_hooks')
    if isinstance(hooks, list):
        for h in hooks:
            if isinstance(h, dict) and h.get('type') == HOOK_TYPE:
                h['checks'] = False


@HOOKS.register_module()
class PreflightCheckHook(Hook):
    """Run :func:`preflight` in ``before_run`` (after mmengine has built the model and the
    train loop, before weights are loaded and before the first iteration) and log where each
    model part's weights came from in ``before_train`` (after ``init_weights`` and
    ``load_from``: :func:`.init_sources.loaded_init_lines`).

    For runners that are not ours (mmdet's ``tools/train.py``, ``mim train``):
    ``custom_hooks = [dict(type='PreflightCheckHook')]``. The base runtime config includes it;
    our ``tools/train.py`` runs the same checks before building anything and sets
    ``checks=False`` (:func:`drop_preflight_hook`).
    """
    priority = 'VERY_HIGH'

    def __init__(self, weights: bool = True, checks: bool = True) -> None:
        self.weights = weights
        self.checks = checks

    def before_run(self, runner) -> None:
        from mmengine.runner import BaseLoop
        if not self.checks:
            return
        cfg = runner.cfg
        # Runner.train() builds its loop before before_run; test() / val() leave it a dict
        training = isinstance(runner._train_loop, BaseLoop)
        wanted = ('train', 'val') if training else ('test',)
        stages = tuple(s for s in wanted if cfg.get(f'{s}_dataloader'))
        try:
            preflight(cfg, stages, weights=self.weights and training, tool=running_tool(),
                      log=runner.logger.info, ours=False)
        except (DatasetNotFoundError, ConfigCheckError, DataCheckError):
            if report_rank() != 0:  # the same report on every rank: rank 0 gives it
                raise SystemExit(1) from None
            raise

    def before_train(self, runner) -> None:
        for line in loaded_init_lines(runner.model, runner.cfg):
            runner.logger.info(line)
