"""What every backbone of ours shares: the output contract and freezing semantics."""
from typing import List, Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_NORMS = (nn.LayerNorm, nn.GroupNorm, _BatchNorm)


def pretrained_init_cfg(init_cfg) -> Optional[dict]:
    """The ``dict(type='Pretrained', checkpoint=...)`` entry of an mmengine ``init_cfg`` (a
    dict or a list of dicts), or None."""
    cfgs = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
    found = [c for c in cfgs if isinstance(c, dict) and c.get('type') == 'Pretrained']
    if len(found) > 1:
        raise ValueError(f'init_cfg lists {len(found)} Pretrained checkpoints; give one')
    return found[0] if found else None


class FreezeMixin:
    """Freezing that works under DDP, and ``train()`` that keeps it.

    Subclasses list their frozen modules in :meth:`frozen_modules` and frozen free-standing
    parameters (e.g. position embeddings) in :meth:`frozen_parameters`. Frozen parameters get
    ``requires_grad=False`` at construction (so DDP never waits for their gradients) and frozen
    modules stay in eval mode through every ``train()``; with ``norm_eval`` all norm layers do.
    ``train()`` / ``eval()`` return the module, so calls chain.

    Attributes expected on the subclass: ``norm_eval`` (bool).
    Contract attributes: ``out_channels`` and ``out_strides`` (tuples, one per output).
    """

    out_channels: Tuple[int, ...]
    out_strides: Tuple[int, ...]
    norm_eval: bool = False

    def frozen_modules(self) -> List[nn.Module]:
        return []

    def frozen_parameters(self) -> List[nn.Parameter]:
        return []

    def _freeze_stages(self) -> None:
        for p in self.frozen_parameters():
            p.requires_grad_(False)
        for m in self.frozen_modules():
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)

    def train(self, mode: bool = True):
        """Set the mode, keeping frozen parts (and norms if ``norm_eval``) in eval mode."""
        super().train(mode)  # type: ignore[misc]
        if mode:
            for m in self.frozen_modules():
                m.eval()
            if self.norm_eval:
                for m in self.modules():  # type: ignore[attr-defined]
                    if isinstance(m, _NORMS):
                        m.eval()
        return self
