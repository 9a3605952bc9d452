"""No weight decay on the parameters our backbones declare, whatever ``custom_keys`` say.

Stock mmdet configs name mmdet's parameters in ``paramwise_cfg.custom_keys`` (e.g. Mask2Former's
``backbone.stages.{i}.blocks.{j}.norm`` with ``decay_mult=0``). mmengine applies the longest
matching custom key and then skips ``norm_decay_mult`` / ``bias_decay_mult``, so with only the
backbone ``type`` changed to ours, the catch-all ``backbone`` key (``decay_mult=1``) puts weight
decay on our norms, biases and relative-position tables. :class:`NoDecayOptimWrapperConstructor`
is mmengine's :class:`~mmengine.optim.DefaultOptimWrapperConstructor` (every ``paramwise_cfg``
option: ``custom_keys`` lr / decay multipliers, ``norm_decay_mult``, ``bias_decay_mult``,
``dwconv_decay_mult``, ``bypass_duplicate``, ...) with one change: every backbone parameter in
``backbone.no_weight_decay()`` (:class:`~vitdet_plugin.models.backbones.BackboneContract`) gets
``weight_decay=0``. Learning rates and everything outside that set stay as mmengine makes them.

In a stock config, one line (plus the plugin import)::

    custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)
    optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')

:func:`decay_report` maps every parameter name to its effective ``(lr, weight_decay)``.
"""
from typing import Dict, List, Mapping, Optional, Set, Tuple, Union

from mmengine.logging import print_log
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapper
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn
from torch.optim import Optimizer

from ..models.backbones.base import BackboneContract, check_contract

__all__ = ['NoDecayOptimWrapperConstructor', 'backbone_of', 'backbone_no_decay_names',
           'decay_report']


def backbone_of(model: nn.Module) -> Tuple[str, BackboneContract]:
    """(prefix of the backbone's parameter names, the backbone) of a detector (its
    ``.backbone``, prefix ``'backbone.'``) or of a backbone itself (prefix ``''``); a
    ``TypeError`` when that backbone does not declare the contract."""
    backbone = getattr(model, 'backbone', None)
    if isinstance(backbone, nn.Module):
        return 'backbone.', check_contract(backbone)
    return '', check_contract(model)


def backbone_no_decay_names(model: nn.Module) -> Set[str]:
    """Names, relative to ``model``, of the backbone's ``no_weight_decay()`` parameters."""
    prefix, backbone = backbone_of(model)
    return {prefix + name for name in backbone.no_weight_decay()}


def _custom_key_of(name: str, sorted_keys: List[str]) -> Optional[str]:
    """The custom key mmengine applies to the parameter ``name``: the first of ``sorted_keys``
    (longest first) contained in ``'{module path}.{param name}'`` (``'.{name}'`` for a
    parameter of the root module), as ``DefaultOptimWrapperConstructor.add_params`` tests it."""
    path = name if '.' in name else '.' + name
    return next((key for key in sorted_keys if key in path), None)


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class NoDecayOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """mmengine's default constructor, plus ``weight_decay=0`` for the backbone's
    ``no_weight_decay()`` parameters (see the module docstring).

    ``paramwise_cfg`` takes exactly mmengine's options. With an empty one, mmengine hands the
    optimizer ``model.parameters()`` as one group; this constructor hands it the same parameters
    as two groups, the no-decay ones with ``weight_decay=0`` and the rest with the optimizer's
    defaults. Otherwise mmengine builds its groups (one per parameter) and the no-decay
    parameters' groups get ``weight_decay=0`` (and ``decay_mult=0`` where a custom key put one
    there); a one-line summary says how many changed and how many of those overrode a custom key.
    """

    paramwise_cfg: dict

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None) -> None:
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        # mmengine's __call__ only calls add_params for a non-empty paramwise_cfg; the flag
        # keeps it non-empty and tells add_params to make mmengine's single group (split).
        self.one_group = not self.paramwise_cfg
        if self.one_group:
            self.paramwise_cfg = dict(one_group=True)

    def add_params(self, params: List[dict], module: nn.Module, prefix: str = '',
                   is_dcn_module: Optional[Union[int, float]] = None) -> None:
        """mmengine's ``add_params``; at the root (``prefix == ''``) the backbone's no-decay
        parameters then get ``weight_decay=0``."""
        if prefix:  # mmengine's recursion into a child module
            super().add_params(params, module, prefix, is_dcn_module)
            return
        no_decay = backbone_no_decay_names(module)
        if self.one_group:
            named = dict(module.named_parameters())
            zero = [p for n, p in named.items() if n in no_decay]
            zero_ids = {id(p) for p in zero}
            params.append(dict(params=[p for p in named.values() if id(p) not in zero_ids]))
            params.append(dict(params=zero, weight_decay=0.0))
            self._log(len(zero), len(zero), 0)
            return
        start = len(params)
        super().add_params(params, module, prefix, is_dcn_module)
        custom_keys: Dict[str, dict] = self.paramwise_cfg.get('custom_keys', {})
        sorted_keys = sorted(sorted(custom_keys), key=len, reverse=True)
        names_of: Dict[int, str] = {id(p): n for n, p in module.named_parameters()
                                    if n in no_decay}
        found, changed, overrode = set(), 0, 0
        for group in params[start:]:
            for p in group['params']:
                name = names_of.get(id(p))
                if name is None:
                    continue
                if len(group['params']) != 1:  # mmengine makes one group per parameter
                    raise RuntimeError(f'{name} shares a param group with other parameters; '
                                       f'{type(self).__name__} expects one per parameter')
                found.add(name)
                if group.get('weight_decay') != 0.0:
                    changed += 1
                    key = _custom_key_of(name, sorted_keys)
                    if key is not None and custom_keys[key].get('decay_mult', 1.0) != 0.0:
                        overrode += 1
                group['weight_decay'] = 0.0
                if 'decay_mult' in group:
                    group['decay_mult'] = 0.0
        self._log(len(found), changed, overrode)

    def _log(self, total: int, changed: int, overrode: int) -> None:
        print_log(f'{type(self).__name__}: weight_decay=0 set on {changed} of the {total} '
                  f'optimized backbone no_weight_decay() parameters ({overrode} over a '
                  'custom_keys decay_mult)', logger='current')


def decay_report(optim: Union[OptimWrapper, Optimizer],
                 model: nn.Module) -> Dict[str, Tuple[float, float]]:
    """``{parameter name: (lr, weight_decay)}`` of every parameter of ``model`` that ``optim``
    (an mmengine optimizer wrapper or a torch optimizer) optimizes, read from its param groups
    and matched by identity. A parameter shared under several names is listed under each;
    parameters outside the optimizer (frozen ones, usually) are left out."""
    optimizer = optim.optimizer if isinstance(optim, OptimWrapper) else optim
    settings: Mapping[int, Tuple[float, float]] = {
        id(p): (float(group['lr']), float(group.get('weight_decay', 0.0)))
        for group in optimizer.param_groups for p in group['params']}
    return {name: settings[id(p)]
            for name, p in model.named_parameters(remove_duplicate=False) if id(p) in settings}
