"""Strict, reported loading of the ``init_cfg`` Pretrained checkpoints of a detector's parts.

A detector built from a checkpoint's parts (a DETR head on the backbone and neck of another
detector) gives each part ``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=...)``.
Our backbones and necks load that themselves, strictly and format-aware (they set
:data:`LOADS_PRETRAINED_ATTR`). mmengine would load any
other part's (mmdet's ``FPN``, the head) with ``strict=False``: missing and unexpected keys are
only logged, a wrong prefix loads nothing. :func:`init_weights_with_strict_parts` runs the
detector's usual ``init_weights`` with those entries held back, then loads them with
the plugged-in loader's ``read_as_saved`` (every key and shape must match) and
logs one line per loaded part.
"""
from typing import Any, Callable, List, Tuple

from mmengine.logging import print_log
from torch import nn

from ...functional.checkpoint_target import checkpoint_loader, pretrained_init_cfg
from ..backbones.base import state_shapes

#: Class attribute of the modules whose ``init_weights`` loads their own Pretrained ``init_cfg``
#: strictly (our backbones and necks); a detector leaves those to them and loads the others'.
LOADS_PRETRAINED_ATTR = 'loads_pretrained_strictly'

#: (part name, module, its Pretrained entry, its whole init_cfg)
_Deferred = Tuple[str, nn.Module, dict, Any]


def _describe(cfg: dict) -> str:
    prefix = cfg.get('prefix')
    return f"{cfg['checkpoint']}" + (f' (prefix {prefix!r})' if prefix else '')


def init_weights_with_strict_parts(model: nn.Module, init_weights: Callable[[], None]) -> None:
    """``init_weights()`` (the detector's mmengine init) with the Pretrained ``init_cfg`` of
    every direct part that does not load it itself replaced by a strict load after it."""
    deferred: List[_Deferred] = []
    own: List[Tuple[str, dict]] = []
    for name, part in model.named_children():
        init_cfg = getattr(part, 'init_cfg', None)
        cfg = pretrained_init_cfg(init_cfg)
        if cfg is None:
            continue
        if getattr(part, LOADS_PRETRAINED_ATTR, False):
            own.append((name, cfg))
            continue
        rest = [c for c in init_cfg if c is not cfg] if isinstance(init_cfg, list) else None
        deferred.append((name, part, cfg, init_cfg))
        part.init_cfg = rest or None  # type: ignore[assignment]
    try:
        init_weights()
    finally:
        for _, part, _, init_cfg in deferred:
            part.init_cfg = init_cfg
    for name, cfg in own:  # loaded strictly by the part itself (or it raised)
        print_log(f'{name}: loaded from {_describe(cfg)} by {type(getattr(model, name)).__name__}'
                  ' (strict)', logger='current')
    for name, part, cfg, _ in deferred:
        state_dict, report = checkpoint_loader().read_as_saved(
            cfg['checkpoint'], cfg.get('prefix'), state_shapes(part), type(part).__name__,
            f'{name} checkpoint')
        part.load_state_dict(state_dict, strict=False)
        print_log(f'{name}: loaded {len(report.loaded)} tensors from {_describe(cfg)} into '
                  f'{type(part).__name__} (strict: every key and shape matched)',
                  logger='current')
