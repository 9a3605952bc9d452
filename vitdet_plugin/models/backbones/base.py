"""What every backbone of ours shares: the declared contract, arch specs and freezing.

The contract (:class:`BackboneContract`) is what configs, necks, optimizers and tests read:

* ``out_channels`` / ``out_strides``: one entry per returned map (and ``feature_info``, the
  same in timm's form);
* ``num_layers`` and ``layer_id(name)``: the depth index of every parameter for layer-wise lr
  decay (0: embeddings, ``1..num_layers``: blocks, ``num_layers + 1``: everything after);
* ``no_weight_decay()``: the parameter names that get no weight decay (norms, biases, position
  embeddings and tables).
"""
import dataclasses
from typing import (Any, Callable, ClassVar, Dict, Iterable, List, Mapping, Optional, Set, Tuple,
                    Type, TypeVar)

import torch
import torch.utils.checkpoint as cp
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...functional.checkpoint_target import checkpoint_loader

_NORMS = (nn.LayerNorm, nn.GroupNorm, _BatchNorm)
#: Parameter names that are biases: ``bias`` and the separate q / v biases of attention
#: without a k bias (EVA-02, DINOv3 ``*_qkvb``: ``attn.q_bias``, ``attn.v_bias``).
BIAS_NAMES = ('bias', 'q_bias', 'v_bias')
#: Standard deviation of the truncated-normal init of transformer weights (Swin, ViT, timm).
TRUNC_NORMAL_STD = 0.02

SpecT = TypeVar('SpecT', bound='ArchSpec')


def init_cfg_from_pretrained(pretrained: Optional[str], init_cfg: Any) -> Any:
    """mmdet's deprecated ``pretrained=PATH`` as an ``init_cfg``."""
    if pretrained is None:
        return init_cfg
    if not isinstance(pretrained, str):
        raise TypeError(f'pretrained must be a checkpoint path or URL (str) or None, got '
                        f'{pretrained!r} ({type(pretrained).__name__}); or give '
                        "init_cfg=dict(type='Pretrained', checkpoint=PATH)")
    if init_cfg is not None:
        raise ValueError('give either pretrained or init_cfg, not both')
    return dict(type='Pretrained', checkpoint=pretrained)


def load_init_checkpoint(module: nn.Module, *options: str) -> bool:
    """Load the ``init_cfg`` Pretrained checkpoint of ``module`` through the plugged-in loader
    (converted for its ``checkpoint_target()``, with the named load ``options`` of the same
    entry); False (nothing loaded) when the init config names none."""
    return checkpoint_loader().load_init(module, options)


def state_shapes(module: nn.Module) -> Dict[str, torch.Size]:
    """``{name: shape}`` of ``module``'s state dict: a checkpoint target's ``expected``."""
    return {k: v.shape for k, v in module.state_dict().items()}


def init_transformer_weights_(module: nn.Module) -> None:
    """The Swin / ViT / timm init of every ``nn.Linear`` and ``nn.LayerNorm`` in ``module``:
    truncated-normal weights (std :data:`TRUNC_NORMAL_STD`), zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=TRUNC_NORMAL_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, with_cp: bool, training: bool,
               block_fn: Optional[Callable[[nn.Module, Tensor], Tensor]] = None) -> Tensor:
    """``x`` through ``blocks`` in turn (``block_fn(block, x)``, e.g. a block call with extra
    arguments, or ``block(x)``); with ``with_cp`` in a training forward that records a graph,
    each block's activations are recomputed in backward (non-reentrant checkpointing)."""
    checkpoint = with_cp and training and torch.is_grad_enabled()
    for block in blocks:
        if block_fn is None:
            x = cp.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
        else:
            x = (cp.checkpoint(block_fn, block, x, use_reentrant=False) if checkpoint
                 else block_fn(block, x))
    return x


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """An architecture preset: a frozen dataclass that validates itself.

    :meth:`resolve` merges a preset name (or a dict of fields) with the fields given directly
    as constructor arguments, rejects unknown keys and missing fields, and builds the spec.
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    NAME: ClassVar[str] = 'arch'

    @classmethod
    def resolve(cls: Type[SpecT], arch: Any, **overrides: Any) -> SpecT:
        fields = [f.name for f in dataclasses.fields(cls)]
        if isinstance(arch, str):
            if arch not in cls.PRESETS:
                raise ValueError(f'unknown {cls.NAME} arch {arch!r}; choose one of '
                                 f'{sorted(cls.PRESETS)} or pass a dict with {fields}')
            spec: Dict[str, Any] = dict(cls.PRESETS[arch])
        elif isinstance(arch, Mapping):
            unknown = sorted(set(arch) - set(fields))
            if unknown:
                raise ValueError(f'{cls.NAME} arch dict has unknown keys {unknown}; accepted: '
                                 f'{fields}')
            spec = dict(arch)
        elif arch is None:
            spec = {}
        else:
            raise TypeError(f'arch must be a preset name, a dict or None, got '
                            f'{type(arch).__name__}')
        spec.update({k: v for k, v in overrides.items() if v is not None})
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in spec]
        if missing:
            raise ValueError(f'{cls.NAME} arch is missing {missing}: give a preset name '
                             f'({sorted(cls.PRESETS)}) or all of {required}')
        return cls(**spec)


class FreezeMixin:
    """Freezing that works under DDP, and ``train()`` that keeps it.

    Subclasses list their frozen modules in :meth:`frozen_modules` and frozen free-standing
    parameters (e.g. position embeddings) in :meth:`frozen_parameters`. Frozen parameters get
    ``requires_grad=False`` at construction (so DDP never waits for their gradients) and frozen
    modules stay in eval mode through every ``train()``; with ``norm_eval`` all norm layers do.
    ``train()`` / ``eval()`` return the module, so calls chain.
    """

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

    def train(self, mode: bool = True) -> Any:
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


class BackboneContract(FreezeMixin):
    """The declared outputs and parameter roles of a backbone (see the module docstring).

    Subclasses set ``out_channels``, ``out_strides`` and ``num_layers`` in their constructor,
    implement :meth:`layer_id` and list their table-like parameters (position embeddings,
    relative-position tables) in :attr:`NO_DECAY_PARAMS`.
    """

    #: Name components (a parameter's own name or a module's on its path, e.g. Swin V2's
    #: ``cpb_mlp``) of parameters that get no weight decay besides norms and biases.
    NO_DECAY_PARAMS: ClassVar[Tuple[str, ...]] = ()
    #: ``init_weights`` loads a Pretrained ``init_cfg`` itself (format detected, strict): see
    #: :data:`~vitdet_plugin.models.detectors.pretrained_parts.LOADS_PRETRAINED_ATTR`.
    loads_pretrained_strictly: ClassVar[bool] = True

    out_channels: Tuple[int, ...]
    out_strides: Tuple[int, ...]
    num_layers: int

    @property
    def feature_info(self) -> List[Dict[str, int]]:
        """timm's form of the output contract: ``num_chs`` and ``reduction`` per output."""
        return [dict(num_chs=c, reduction=s) for c, s in zip(self.out_channels, self.out_strides)]

    def fit_input(self, size: Tuple[int, int]) -> Tuple[int, int]:
        """The smallest input ``(H, W)``, side by side at least ``size``, that the backbone
        takes: ``size`` itself for the backbones that pad inside (every one but RF-DETR's
        windowed DINOv2). Exporters trace and check a part at this size."""
        return size

    def layer_id(self, name: str) -> int:
        """Layer-decay depth of the parameter ``name`` (relative to the backbone)."""
        raise NotImplementedError

    def no_weight_decay(self) -> Set[str]:
        """Names (relative to the backbone) of the parameters without weight decay: every
        parameter of a norm layer, every bias (:data:`BIAS_NAMES`) and every parameter with a
        :attr:`NO_DECAY_PARAMS` component in its name."""
        names: Set[str] = set()
        tables = set(self.NO_DECAY_PARAMS)
        for mod_name, module in self.named_modules():  # type: ignore[attr-defined]
            for p_name, _ in module.named_parameters(recurse=False):
                full = f'{mod_name}.{p_name}' if mod_name else p_name
                if (isinstance(module, _NORMS) or p_name in BIAS_NAMES
                        or not tables.isdisjoint(full.split('.'))):
                    names.add(full)
        return names


def check_contract(backbone: nn.Module) -> BackboneContract:
    """``backbone`` if it declares the :class:`BackboneContract`, else a ``TypeError`` naming
    the fix."""
    if not isinstance(backbone, BackboneContract):
        raise TypeError(f'{type(backbone).__name__} does not declare the backbone contract '
                        '(out_channels, out_strides, num_layers, layer_id, no_weight_decay); '
                        'derive it from vitdet_plugin.models.backbones.BackboneContract or use '
                        'SwinBackbone / ViTBackbone')
    return backbone
