"""Training-engine pieces registered into mmengine's registries (importing registers them)."""
from . import checkpoint, hooks, time_budget  # noqa: F401  (register our training hooks)
from .layer_decay import (DEFAULT_NO_DECAY_NAMES, LayerDecayOptimWrapperConstructor,
                          swin_layer_id, vit_layer_id)

__all__ = ['DEFAULT_NO_DECAY_NAMES', 'LayerDecayOptimWrapperConstructor', 'swin_layer_id',
           'vit_layer_id']
