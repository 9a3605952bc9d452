"""Layer-wise learning-rate decay for our backbones (BEiT / MAE / ViTDet recipe).

The constructor reads the backbone's declared contract
(:class:`~vitdet_plugin.models.backbones.BackboneContract`): ``num_layers`` (``L``),
``layer_id(name)`` and ``no_weight_decay()``. A parameter at layer ``l`` of ``L + 1`` gets
``lr = base_lr * rate ** (L + 1 - l)``. The backbones' rules:

* ViT (:class:`ViTBackbone`, detectron2 ``get_vit_lr_decay_rate``): patch / position
  embeddings are layer 0, block ``i`` is layer ``i + 1``; ``L`` = number of blocks. Residual
  conv blocks are new layers and keep the full rate, as in detectron2.
* Swin (:class:`SwinBackbone`, mmpretrain's rule): patch embedding and absolute position
  embedding are layer 0; blocks are numbered over all stages (``layers.{i}.blocks.{j}`` is layer
  ``sum(depths[:i]) + j + 1``), a stage's ``downsample`` shares the layer of its last block;
  ``L = sum(depths)``.
* Everything else (output norms ``norm{i}``, the in-backbone pyramid, neck, heads) is layer
  ``L + 1`` (full rate).

Weight decay is 0 for the backbone's ``no_weight_decay()`` parameters (its norms, biases,
position embeddings and relative-position tables); outside the backbone, for norm layers and
biases (``norm_decay_mult`` / ``bias_decay_mult``) and the :data:`DEFAULT_NO_DECAY_NAMES`;
``base_wd`` elsewhere, and on the ``decay_names`` whatever the rules above say (RF-DETR decays
the ViT's LayerScale, which the backbone declares no-decay). ``lr_mults`` scales the lr of whole
modules on top (RF-DETR's lower ViT and decoder rates). Parameters are grouped by (layer,
decay, multiplier) and each group carries ``lr_scale``, ``layer_id`` and ``param_names`` for
inspection.

Config::

    optim_wrapper = dict(
        type='OptimWrapper', optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.1),
        constructor='LayerDecayOptimWrapperConstructor',
        paramwise_cfg=dict(layer_decay_rate=0.7))
"""
import logging
from typing import Dict, List, Optional, Set, Tuple

from mmengine.logging import print_log
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from .no_decay import backbone_no_decay_names, backbone_of

#: Parameter names (last component) that never get weight decay.
DEFAULT_NO_DECAY_NAMES = ('pos_embed', 'absolute_pos_embed', 'relative_position_bias_table',
                          'rel_pos_h', 'rel_pos_w', 'cls_token', 'dist_token', 'mask_token')
_NORM_TYPES = (_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
_OPTIONS = ('layer_decay_rate', 'num_layers', 'no_decay_names', 'extra_no_decay_names',
            'decay_names', 'norm_decay_mult', 'bias_decay_mult', 'lr_mults')


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class LayerDecayOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """Optimizer-wrapper constructor with layer-wise lr decay (see the module docstring).

    ``paramwise_cfg`` options:
        layer_decay_rate (float): decay per layer, in ``(0, 1]`` (ViTDet: 0.7 for ViT-B,
            0.8 for ViT-L, 0.9 for ViT-H).
        num_layers (int, optional): ``L``; defaults to the backbone's block count and may only
            be raised (deeper layers would otherwise get rates above the base lr).
        no_decay_names (sequence of str, optional): names without weight decay, matched against
            every dotted component of a parameter's name (``'query_embed'`` matches
            ``panoptic_head.query_embed.weight``); replaces :data:`DEFAULT_NO_DECAY_NAMES`.
        extra_no_decay_names (sequence of str, optional): added to ``no_decay_names`` (e.g. a
            DETR / Mask2Former head's ``('query_embed', 'query_feat', 'level_embed')``).
        decay_names (sequence of str, optional): names matched the same way that get the base
            weight decay even where the backbone's ``no_weight_decay()`` or the names above
            exempt them (RF-DETR's recipe: ``['gamma']``, the ViT's LayerScale).
        norm_decay_mult, bias_decay_mult (float): weight-decay multipliers of norm layers and
            biases (default 0).
        lr_mults (dict, optional): module name -> lr multiplier for the parameters below it
            (the longest name wins), on top of the layer decay; RF-DETR's recipe:
            ``{'backbone': 0.735, 'bbox_head.decoder': 0.7}``.
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None) -> None:
        super().__init__(optim_wrapper_cfg, None)
        cfg = dict(paramwise_cfg or {})
        unknown = sorted(set(cfg) - set(_OPTIONS))
        if unknown:
            raise ValueError(f'paramwise_cfg has unsupported keys {unknown} for '
                             f'{type(self).__name__}; accepted: {list(_OPTIONS)}')
        rate = float(cfg.get('layer_decay_rate', 1.0))
        if not 0.0 < rate <= 1.0:
            raise ValueError(f'layer_decay_rate={rate} must be in (0, 1]')
        num_layers = cfg.get('num_layers')
        if num_layers is not None and int(num_layers) <= 0:
            raise ValueError(f'num_layers={num_layers} must be a positive int')
        if self.base_lr is None:
            raise ValueError('the optimizer config needs an lr for layer-wise lr decay')
        self.layer_decay_rate = rate
        self.num_layers = None if num_layers is None else int(num_layers)
        for key in ('no_decay_names', 'extra_no_decay_names', 'decay_names'):
            if isinstance(cfg.get(key), str):
                raise ValueError(f'{key}={cfg[key]!r} must be a list of names, e.g. '
                                 f'[{cfg[key]!r}]')
        self.no_decay_names = frozenset(cfg.get('no_decay_names', DEFAULT_NO_DECAY_NAMES)) | \
            frozenset(cfg.get('extra_no_decay_names', ()))
        self.decay_names = frozenset(cfg.get('decay_names', ()))
        self.norm_decay_mult = float(cfg.get('norm_decay_mult', 0.0))
        self.bias_decay_mult = float(cfg.get('bias_decay_mult', 0.0))
        self.lr_mults = {str(k): float(v) for k, v in dict(cfg.get('lr_mults') or {}).items()}
        if any(v <= 0 for v in self.lr_mults.values()):
            raise ValueError(f'lr_mults={self.lr_mults} must be positive multipliers')
        cfg.setdefault('layer_decay_rate', rate)  # non-empty: always go through add_params
        self.paramwise_cfg = cfg

    def _decay_mult(self, name: str, module: nn.Module, no_decay: Set[str]) -> float:
        """The weight-decay multiplier of parameter ``name`` of ``module`` (``no_decay``: the
        backbone's no-decay parameter names)."""
        short = name.rsplit('.', 1)[-1]
        if not self.decay_names.isdisjoint(name.split('.')):
            return 1.0
        if name in no_decay or not self.no_decay_names.isdisjoint(name.split('.')):
            return 0.0
        if isinstance(module, _NORM_TYPES):
            return self.norm_decay_mult
        if short == 'bias':
            return self.bias_decay_mult
        return 1.0

    def _lr_mult(self, name: str) -> float:
        """The ``lr_mults`` entry of the longest module name that contains parameter ``name``."""
        owners = [k for k in self.lr_mults if name.startswith(k + '.')]
        return self.lr_mults[max(owners, key=len)] if owners else 1.0

    def add_params(self, params: List[dict], module: nn.Module, **kwargs) -> None:
        """Append one group per (layer, weight decay) to ``params``."""
        prefix, backbone = backbone_of(module)
        backbone_layers = backbone.num_layers
        num_layers = self.num_layers or backbone_layers
        if num_layers < backbone_layers:
            raise ValueError(f'num_layers={num_layers} is smaller than the backbone\'s '
                             f'{backbone_layers} layers; omit it to use the backbone depth')
        base_wd = self.base_wd or 0.0
        no_decay = backbone_no_decay_names(module)
        owner = {f'{mod_name}.{p_name}' if mod_name else p_name: mod
                 for mod_name, mod in module.named_modules()
                 for p_name, _ in mod.named_parameters(recurse=False)}
        groups: Dict[Tuple[int, float, float], dict] = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:
                print_log(f'{name} is frozen (requires_grad=False) and not optimized',
                          logger='current', level=logging.DEBUG)
                continue
            if prefix and not name.startswith(prefix):
                layer = num_layers + 1
            else:
                layer = min(backbone.layer_id(name[len(prefix):]), num_layers + 1)
                if layer == backbone_layers + 1:
                    layer = num_layers + 1
            wd = base_wd * self._decay_mult(name, owner[name], no_decay)
            mult = self._lr_mult(name)
            group = groups.get((layer, wd, mult))
            if group is None:
                scale = self.layer_decay_rate ** (num_layers + 1 - layer) * mult
                group = groups[(layer, wd, mult)] = dict(
                    params=[], param_names=[], lr=self.base_lr * scale, weight_decay=wd,
                    lr_scale=scale, layer_id=layer)
            group['params'].append(param)
            group['param_names'].append(name)
        for (layer, wd, _), group in sorted(groups.items()):
            print_log(f'layer decay: layer {layer} lr_scale={group["lr_scale"]:.4g} '
                      f'weight_decay={wd:g}: {len(group["params"])} params',
                      logger='current', level=logging.DEBUG)
            params.append(group)
