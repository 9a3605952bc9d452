"""What mmengine loads into a built model, checked against that model first.

mmengine loads a whole-model checkpoint non-strictly: ``load_from`` (``tools/train.py``,
``tools/test.py``), ``mmengine.runner.load_checkpoint`` and a module's
``init_cfg=dict(type='Pretrained', checkpoint=...)`` (its ``PretrainedInit``) skip every tensor
of another shape than the model's with a log line, and the run goes on (and a test exits 0)
with those parts at their init. Our backbones and necks load their own ``init_cfg`` strictly
(:mod:`.pretrained`); this module covers the rest. :func:`install` routes mmengine's
``_load_checkpoint_to_model`` through :func:`fit_checkpoint`, which, before mmengine loads:

* starts a fine-tuned head from the checkpoint as rfdetr does when the load is a fine-tuning
  start (a module's Pretrained ``init_cfg``, which runs in training only; :func:`fine_tuning`):
  an RF-DETR head's class branches take rfdetr's re-initialised rows for the model's classes
  (:func:`~.rfdetr_classes.finetune_rows`, from the file's classifier as saved when mmengine
  read an rfdetr file, :func:`~.rfdetr.as_detector_checkpoint`); every other tensor loads as is;
* converts a whole D-FINE / DEIMv2 detector (a transformers folder or an official file, read as
  its state dict by :mod:`vitdet_plugin.compat`) to the model's names strictly; a fine-tuning
  start from an official file of other classes keeps the head's class branches at their init
  (:func:`_convert_dfine`);
* refuses (:class:`CheckpointError`) a checkpoint with any tensor of another shape than the
  model's, naming the fix: the config of an RF-DETR checkpoint's size, the ``num_classes`` of
  its head (and its class names), or the tensors that differ.

Keys the model lacks or the checkpoint lacks stay mmengine's to report (logged).
"""
import contextlib
import contextvars
import functools
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from mmengine.logging import print_log
from torch import Size, Tensor, nn

from .checkpoint_io import CheckpointError
from .dfine_detector import dfine_detector_layout, dfine_to_detector
from .dfine_official import official_family, official_to_detector
from .rfdetr import (SAVED_CLASSIFIER, has_mask_branch, is_rfdetr_detector, read_size,
                     size_refusal)
from .rfdetr_classes import CLASS_ROWS, class_entries, finetune_rows, select_rows, show_names

#: Whether the load under way is a fine-tuning start (a Pretrained ``init_cfg``).
_FINE_TUNING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    'vitdet_plugin_fine_tuning', default=False)
#: Our LWDETRHead's classifier bias: its rows are the head's classes.
HEAD_CLASSES = 'bbox_head.cls_branch.bias'
#: How many mismatched tensors a refusal lists.
SHOWN_MISMATCHES = 3
#: Our DFineHead's class branches: the encoder's and each decoder layer's score heads and the
#: denoising class embedding (``num_classes + 1`` rows, as the checkpoints' keys below).
DFINE_CLASS_BRANCHES = re.compile(
    r'^bbox_head\.(?:selector\.enc_score_head|decoder\.cls_branches\.\d+|dn_label_embed)\.')
DFINE_DN_EMBED = 'bbox_head.dn_label_embed.weight'
#: The denoising class embedding of an official checkpoint.
DFINE_OFFICIAL_DN_EMBED = 'decoder.denoising_class_embed.weight'
#: mmengine's default ``revise_keys`` (a DDP wrapper's prefix).
MODULE_PREFIX: Sequence[Tuple[str, str]] = ((r'^module\.', ''),)


@contextlib.contextmanager
def fine_tuning() -> Iterator[None]:
    """Loads inside are fine-tuning starts: a head of other classes starts from rfdetr's
    re-initialised class rows instead of being refused."""
    token = _FINE_TUNING.set(True)
    try:
        yield
    finally:
        _FINE_TUNING.reset(token)


def fit_checkpoint(model: nn.Module, checkpoint: Mapping[str, Any],
                   revise_keys: Sequence[Tuple[str, str]] = MODULE_PREFIX) -> None:
    """Check (and, for a fine-tuning start, adapt in place) what mmengine is about to load
    from ``checkpoint`` into ``model``; see the module docstring. ``revise_keys``: mmengine's
    ``(pattern, replacement)`` renames of the checkpoint's keys."""
    state = checkpoint['state_dict'] if 'state_dict' in checkpoint else checkpoint
    if not isinstance(state, dict):
        return
    if dfine_detector_layout(state) is not None or official_family(state) is not None:
        _convert_dfine(model, state)
    ours = {revise_key(k, revise_keys): k for k in state if isinstance(state[k], Tensor)}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    owner = type(model).__name__
    if _FINE_TUNING.get():
        _start_classes(state, ours, checkpoint.get(SAVED_CLASSIFIER), expected, owner)
    shapes = {new: tuple(state[old].shape) for new, old in ours.items()}
    mismatched = [k for k, s in shapes.items() if k in expected and s != expected[k]]
    if mismatched:
        meta = checkpoint.get('meta')
        names = ((meta.get('dataset_meta') or {}).get('classes')
                 if isinstance(meta, Mapping) else None)
        raise CheckpointError(mismatch_message(shapes, expected, mismatched, owner, names))


def _convert_dfine(model: nn.Module, state: Dict[str, Tensor]) -> None:
    """Convert in place a whole D-FINE / DEIMv2 detector, a transformers folder's or an
    official file's, to ``model``'s names, strictly. An official file of other classes than
    the model's head is refused, except in a fine-tuning start: there the class branches
    (:data:`DFINE_CLASS_BRANCHES`) keep the model's initial values and all else loads, as the
    official repositories' ``load_tuning_state`` does (it skips every tensor of another
    shape)."""
    current = model.state_dict()
    expected = {k: v.shape for k, v in current.items()}
    owner = type(model).__name__
    bins = getattr(getattr(model, 'bbox_head', None), 'bins', None)
    if dfine_detector_layout(state) is not None:
        converted, _ = dfine_to_detector(state, expected, owner, bins)
        state.clear()
        state.update(converted)
        return
    have = int(state[DFINE_OFFICIAL_DN_EMBED].shape[0]) - 1
    want = int(expected[DFINE_DN_EMBED][0]) - 1 if DFINE_DN_EMBED in expected else have
    branches = [k for k in expected if DFINE_CLASS_BRANCHES.match(k)]
    other = have != want
    if other:  # convert at the file's classes
        expected.update({k: Size((expected[k][0] + have - want, *expected[k][1:]))
                         for k in branches})
    converted, _ = official_to_detector(state, expected, owner, bins)
    if other:
        if not _FINE_TUNING.get():
            raise CheckpointError(
                f"the checkpoint's head has {have} classes; the head of {owner} was built with "
                f'num_classes={want}: build it with num_classes={have} (--cfg-options '
                f'model.bbox_head.num_classes={have}), or, to fine-tune a head of other classes '
                "from it, give it as the detector's init_cfg=dict(type='Pretrained', "
                'checkpoint=...) (configs/deimv2/deimv2_s_finetune_custom.py)')
        converted.update({k: current[k] for k in branches})
        print_log(f'{owner}: the checkpoint has {have} classes, the head {want}: its class '
                  f"branches keep their initial values ({', '.join(branches)}), as the official "
                  "load_tuning_state skips them; every other tensor loads", logger='current')
    state.clear()
    state.update(converted)


def _start_classes(state: Dict[str, Tensor], ours: Mapping[str, str],
                   saved: Optional[Mapping[str, Tensor]],
                   expected: Mapping[str, Tuple[int, ...]], owner: str) -> None:
    """Give the RF-DETR class branches of ``state`` rfdetr's fine-tuning rows for the model's
    classes (from ``saved``, the file's classifier as saved, when given)."""
    source = dict(saved) if saved else class_entries({k: state[v] for k, v in ours.items()})
    if HEAD_CLASSES not in source or HEAD_CLASSES not in expected:
        return
    logits, classes = int(source[HEAD_CLASSES].shape[0]), expected[HEAD_CLASSES][0]
    rows = select_rows(source, finetune_rows(logits, classes))
    for key, value in rows.items():
        if key in ours and key in expected:
            state[ours[key]] = value
    print_log(f'{owner}: the class branches start from the checkpoint\'s {logits} class rows '
              f'as rfdetr\'s reinitialize_detection_head sets them for {classes} classes',
              logger='current')


def mismatch_message(shapes: Mapping[str, Tuple[int, ...]],
                     expected: Mapping[str, Tuple[int, ...]], mismatched: List[str],
                     owner: str, names: Optional[Sequence[str]] = None) -> str:
    """Why a checkpoint of ``shapes`` (the model's names) does not load into ``owner`` of
    ``expected``, and the fix."""
    refusal = (size_refusal(read_size(shapes), read_size(expected), owner,
                            has_mask_branch(shapes))
               if is_rfdetr_detector(shapes) and is_rfdetr_detector(expected) else None)
    if refusal:
        return refusal
    if HEAD_CLASSES in mismatched and all(CLASS_ROWS.match(k) for k in mismatched):
        have, want = shapes[HEAD_CLASSES][0], expected[HEAD_CLASSES][0]
        return (f"the checkpoint's head has {have} classes{show_names(names)}; the head of "
                f'{owner} was built with num_classes={want}: build it with num_classes={have} '
                f'(--cfg-options model.bbox_head.num_classes={have}), or, to fine-tune a head '
                "of other classes from it, give it as the detector's init_cfg=dict(type="
                "'Pretrained', checkpoint=...) (configs/rfdetr/rfdetr_nano_finetune_custom.py)")
    listed = '; '.join(f'{k}: {shapes[k]} in the checkpoint, {expected[k]} in the model'
                       for k in mismatched[:SHOWN_MISMATCHES])
    more = ', ...' if len(mismatched) > SHOWN_MISMATCHES else ''
    return (f'{len(mismatched)} tensors of the checkpoint do not fit {owner} ({listed}{more}): '
            'load it into the model it was saved from (its config: sizes and num_classes), '
            "or load its backbone alone (the backbone's init_cfg=dict(type='Pretrained', "
            'checkpoint=...))')


def revise_key(key: str, revise_keys: Sequence[Tuple[str, str]] = MODULE_PREFIX) -> str:
    """``key`` as mmengine's ``load_checkpoint`` renames it (``revise_keys``: its
    ``(pattern, replacement)`` pairs, by default a DDP wrapper's prefix dropped)."""
    for pattern, replacement in revise_keys:
        key = re.sub(pattern, replacement, key)
    return key


def _checked(load: Callable[..., Any]) -> Callable[..., Any]:
    """mmengine's ``_load_checkpoint_to_model`` with :func:`fit_checkpoint` first."""
    @functools.wraps(load)
    def load_checkpoint_to_model(model: nn.Module, checkpoint: Any, strict: bool = False,
                                 logger: Any = None,
                                 revise_keys: Sequence[Tuple[str, str]] = MODULE_PREFIX) -> Any:
        if isinstance(checkpoint, Mapping):
            fit_checkpoint(model, checkpoint, revise_keys)
        return load(model, checkpoint, strict, logger, revise_keys)
    return load_checkpoint_to_model


def _fitted_first(after_load: Callable[..., Any]) -> Callable[..., Any]:
    """mmengine's ``EMAHook.after_load_checkpoint`` (which the runner calls before it loads
    the model, and which copies ``checkpoint['state_dict']`` into the EMA model) with
    :func:`fit_checkpoint` first, so that it copies the converted state."""
    @functools.wraps(after_load)
    def after_load_checkpoint(self: Any, runner: Any, checkpoint: Any) -> Any:
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        if isinstance(checkpoint, Mapping):
            fit_checkpoint(model, checkpoint)
        return after_load(self, runner, checkpoint)
    return after_load_checkpoint


def _as_fine_tuning(call: Callable[..., Any]) -> Callable[..., Any]:
    """mmengine's ``PretrainedInit.__call__`` run as a fine-tuning start."""
    @functools.wraps(call)
    def pretrained_init(self: Any, module: nn.Module) -> Any:
        with fine_tuning():
            return call(self, module)
    return pretrained_init


def install() -> None:
    """Route mmengine's ``_load_checkpoint_to_model`` (the checkpoint module's and the
    runner's copy) and ``EMAHook.after_load_checkpoint`` through :func:`fit_checkpoint` and run
    its ``PretrainedInit`` as a fine-tuning start (idempotent)."""
    import mmengine.runner.checkpoint as checkpoint_module
    import mmengine.runner.runner as runner_module
    from mmengine.hooks import EMAHook
    from mmengine.model.weight_init import PretrainedInit

    load = checkpoint_module._load_checkpoint_to_model
    checked = _checked(getattr(load, '__wrapped__', load))
    checkpoint_module._load_checkpoint_to_model = checked
    runner_module._load_checkpoint_to_model = checked
    call = PretrainedInit.__call__
    PretrainedInit.__call__ = _as_fine_tuning(
        getattr(call, '__wrapped__', call))
    after_load = EMAHook.after_load_checkpoint
    EMAHook.after_load_checkpoint = _fitted_first(
        getattr(after_load, '__wrapped__', after_load))
