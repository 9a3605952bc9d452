"""Strict, reported loading into a module that describes itself with a
:class:`~vitdet_plugin.functional.checkpoint_target.CheckpointTarget` (our backbones): its
target goes to the layout table (:func:`.layouts.load_checkpoint`), which converts and checks;
the result is loaded here. :func:`load_init_checkpoint` is what the models reach through the
contract (``checkpoint_loader().load_init``) from their ``init_weights``."""
import dataclasses
from typing import Any, Optional, Sequence

from torch import nn

from ..functional.checkpoint_target import CheckpointSource, LoadReport, pretrained_init_cfg
from .layouts import load_checkpoint

#: Attribute where a module keeps the LoadReport of its ``init_cfg`` checkpoint (read by the
#: pre-flight hook's init-source lines, :mod:`vitdet_plugin.checks.init_sources`).
INIT_REPORT_ATTR = 'init_report'


def load_pretrained(module: nn.Module, checkpoint: CheckpointSource,
                    prefix: Optional[str] = None, **options: Any) -> LoadReport:
    """Load a checkpoint of any layout of the table into ``module`` (strict, reported): its
    ``checkpoint_target()`` (a CheckpointTarget), with the load ``options`` (e.g.
    ``src_window_size``), is converted for by :func:`.layouts.load_checkpoint`."""
    describe = getattr(module, 'checkpoint_target', None)
    if not callable(describe):
        raise TypeError(f'{type(module).__name__} has no checkpoint_target(); load its weights '
                        'with load_state_dict')
    target = dataclasses.replace(describe(), **{k: v for k, v in options.items() if v is not None})
    state_dict, report = load_checkpoint(checkpoint, target, prefix)
    module.load_state_dict(state_dict, strict=False)
    return report


def load_init_checkpoint(module: nn.Module, options: Sequence[str] = ()) -> bool:
    """Load the ``init_cfg`` Pretrained checkpoint of ``module`` (:func:`load_pretrained`, with
    the named ``options`` read from the same init config) and mark it initialised; False
    (nothing loaded) when the init config names none."""
    pretrained = pretrained_init_cfg(getattr(module, 'init_cfg', None))
    if pretrained is None:
        return False
    report = load_pretrained(module, pretrained['checkpoint'], pretrained.get('prefix'),
                             **{name: pretrained.get(name) for name in options})
    setattr(module, INIT_REPORT_ATTR, report)  # the train log's "init backbone ..." line
    setattr(module, '_is_init', True)  # noqa: B010  (mmengine BaseModule's init flag)
    return True
