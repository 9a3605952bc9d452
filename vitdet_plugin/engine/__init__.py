"""Training-engine pieces registered into mmengine's registries (importing registers them)."""
from . import checkpoint, hooks, nonfinite, time_budget  # noqa: F401  (register our training hooks)
from . import fsdp, fsdp_runner  # noqa: F401  (register FSDP2Wrapper, FSDP2Runner)
from .layer_decay import DEFAULT_NO_DECAY_NAMES, LayerDecayOptimWrapperConstructor
from .no_decay import NoDecayOptimWrapperConstructor, backbone_no_decay_names, decay_report

__all__ = ['DEFAULT_NO_DECAY_NAMES', 'LayerDecayOptimWrapperConstructor',
           'NoDecayOptimWrapperConstructor', 'backbone_no_decay_names', 'decay_report']
