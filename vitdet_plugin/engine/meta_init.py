"""Meta-device initialisation of a sharded model (``FSDP2Wrapper(init_device='meta')``): no
rank ever holds the full weights of its pretrained parts.

1. **Build** (:func:`build_with_meta_parts`, called by ``FSDP2Runner.build_model`` on every
   rank): every part that loads its own Pretrained ``init_cfg`` through the layout table (our
   backbones and necks, ``LOADS_PRETRAINED_ATTR`` of :mod:`~vitdet_plugin.models.detectors.
   pretrained_parts`) is built on the meta device (no memory); the rest of the detector
   (neck, head: small) is built and initialised as usual (its ``init_weights``, with the meta
   parts held out). The same seed gives the same rest on every rank; it differs in value from
   a model built whole (the meta parts draw no random numbers while they are built), not in
   distribution.
2. **Before sharding** (:class:`MetaInit`): each meta part's checkpoint is read lazily
   (:func:`~vitdet_plugin.weights.lazy.read_lazily`: memory-mapped) and converted for the part
   by the layout table (the same converters and strict checks as ``init_weights``); the
   initialised rest is kept aside and the whole model moved to the meta device.
3. **After sharding** (:meth:`MetaInit.materialise`): every rank allocates its shards
   (``to_empty``) and copies into them its slice of each full tensor (the rest's, then the
   checkpoint's, one tensor at a time; the file's pages are dropped again after each).

Peak host memory per rank: its shards + the rest + one tensor of the file (+ the tensors a
converter computes, e.g. a resampled position grid). Measured in docs/large_models.md.
"""
import copy
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from mmdet.registry import MODELS
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..functional.checkpoint_target import (CheckpointTarget, LoadReport, checkpoint_loader,
                                            pretrained_init_cfg)
from ..models.detectors.pretrained_parts import LOADS_PRETRAINED_ATTR
from ..weights.lazy import LazyCheckpoint, read_lazily
from ..weights.pretrained import INIT_REPORT_ATTR

logger = logging.getLogger('vitdet_plugin')

#: the registered builder that builds its ``module`` config on the meta device
META_BUILDER = 'BuiltOnMeta'
#: Pretrained ``init_cfg`` keys that are no load option of the checkpoint target
_CFG_KEYS = ('type', 'checkpoint', 'prefix', 'map_location')
_TARGET_FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointTarget))


@MODELS.register_module(name=META_BUILDER)
def built_on_meta(module: dict) -> nn.Module:
    """``module`` (a model config) built on the meta device."""
    with torch.device('meta'):
        return MODELS.build(module)


def _loads_own_pretrained(cfg: Mapping) -> bool:
    kind = cfg.get('type')
    cls = MODELS.get(kind) if isinstance(kind, str) else kind
    return (isinstance(cls, type) and getattr(cls, LOADS_PRETRAINED_ATTR, False)
            and pretrained_init_cfg(cfg.get('init_cfg')) is not None)


def meta_parts_cfg(cfg: Any) -> Any:
    """``cfg`` (a model config) with every sub-config of a part that loads its own Pretrained
    checkpoint wrapped into :data:`META_BUILDER` (built on the meta device)."""
    if isinstance(cfg, Mapping):
        if 'type' in cfg and _loads_own_pretrained(cfg):
            return dict(type=META_BUILDER, module=copy.deepcopy(dict(cfg)))
        return {k: meta_parts_cfg(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(meta_parts_cfg(v) for v in cfg)
    return cfg


def meta_parts(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every part of ``model`` on the meta device that loads its own
    Pretrained checkpoint (outermost only)."""
    found: List[Tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(p == '' or name.startswith(f'{p}.') for p, _ in found):
            continue
        on_meta = any(t.is_meta for t in m.parameters())
        if (on_meta and getattr(m, LOADS_PRETRAINED_ATTR, False)
                and callable(getattr(m, 'checkpoint_target', None))
                and pretrained_init_cfg(getattr(m, 'init_cfg', None)) is not None):
            found.append((name, model.get_submodule(name)))
    return found


def build_with_meta_parts(build: Callable[[Any], nn.Module], cfg: Any) -> nn.Module:
    """The model of ``cfg`` built by ``build`` with its pretrained parts on the meta device
    (:func:`meta_parts_cfg`) and the rest initialised by the model's ``init_weights``, the
    meta parts held out of it (they are loaded after sharding, :class:`MetaInit`)."""
    model = build(meta_parts_cfg(cfg))
    parts = meta_parts(model)
    if any(name == '' for name, _ in parts):  # the model is the pretrained part
        return model
    stubs = []
    for name, part in parts:
        parent, _, attr = name.rpartition('.')
        holder = model.get_submodule(parent)
        stubs.append((holder, attr, part))
        setattr(holder, attr, nn.Module())  # no parameters, no init_weights
    init_weights = getattr(model, 'init_weights', None)
    try:
        if callable(init_weights):
            init_weights()
    finally:
        for holder, attr, part in stubs:
            setattr(holder, attr, part)
    return model


def copy_full_(dst: Tensor, full: Tensor) -> None:
    """Copy into ``dst`` (a parameter or buffer; a DTensor shard or a plain tensor) its part of
    ``full`` (the whole tensor, the same on every rank: no communication)."""
    with torch.no_grad():
        if isinstance(dst, DTensor):
            local = distribute_tensor(full.to(dst.device), dst.device_mesh, dst.placements,
                                      src_data_rank=None).to_local()
            dst.to_local().copy_(local)
        else:
            dst.copy_(full)


def reset_uncovered(model: nn.Module, names: List[str]) -> None:
    """Give the tensors ``names`` of the pretrained parts that their checkpoints leave out (the
    keys a layout may lack, e.g. Swin's detection output norms) their constructor's values:
    their modules are allocated on the CPU and ``reset_parameters()``; a module without it, or
    with other tensors from the checkpoint, is refused naming the fix."""
    owners: Dict[str, List[str]] = {}
    for name in names:
        owner, _, attr = name.rpartition('.')
        owners.setdefault(owner, []).append(attr)
    for owner, attrs in owners.items():
        module = model.get_submodule(owner)
        own = [n for n, _ in [*module.named_parameters(recurse=False),
                              *module.named_buffers(recurse=False)]]
        reset = getattr(module, 'reset_parameters', None)
        if not callable(reset) or sorted(own) != sorted(attrs):
            raise ValueError(
                f"FSDP2Wrapper(init_device='meta'): {owner}.{attrs[0]} is not in the "
                f'checkpoint of its part and {type(module).__name__} cannot be reset on its '
                'own (reset_parameters); use init_on_rank0=True for this model')
        module.to_empty(device='cpu', recurse=False)
        reset()


def _join(prefix: str, key: str) -> str:
    return f'{prefix}.{key}' if prefix else key


def named_state(model: nn.Module) -> Dict[str, Tensor]:
    """Every parameter and buffer of ``model`` (persistent or not) by its dotted name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@dataclasses.dataclass
class _Part:
    name: str
    module: nn.Module
    cfg: dict
    checkpoint: LazyCheckpoint
    converted: Dict[str, Tensor]
    report: LoadReport


class MetaInit:
    """The meta path of :class:`~.fsdp.FSDP2Wrapper` around the sharding: construct it on the
    unsharded model (its pretrained parts on the meta device; checkpoints read and converted,
    the rest kept aside, the model moved to the meta device), shard, then
    :meth:`materialise`."""

    def __init__(self, model: nn.Module) -> None:
        self.parts = [self._read(name, part) for name, part in meta_parts(model)]
        covered = {_join(p.name, k) for p in self.parts for k in p.converted}
        reset_uncovered(model, [n for n, t in named_state(model).items()
                                if t.is_meta and n not in covered])
        #: the initialised rest (full tensors, the same on every rank)
        self.rest = {n: t.detach() for n, t in named_state(model).items() if not t.is_meta}
        model.to_empty(device='meta')  # the rest's memory stays with self.rest

    @staticmethod
    def _read(name: str, part: nn.Module) -> _Part:
        cfg = pretrained_init_cfg(getattr(part, 'init_cfg', None))
        describe = getattr(part, 'checkpoint_target', None)
        assert cfg is not None and callable(describe)
        options = {k: v for k, v in cfg.items()
                   if k not in _CFG_KEYS and k in _TARGET_FIELDS and v is not None}
        target = dataclasses.replace(describe(), **options)
        checkpoint = read_lazily(cfg['checkpoint'])
        converted, report = checkpoint_loader().convert(checkpoint.tensors, target,
                                                        cfg.get('prefix'))
        return _Part(name, part, cfg, checkpoint, dict(converted), report)

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Allocate this rank's shards of the sharded ``model`` and fill them: the rest, then
        each part's checkpoint tensors, one at a time."""
        model.to_empty(device=device)
        state = named_state(model)
        for name in list(self.rest):
            copy_full_(state[name], self.rest.pop(name))
        for part in self.parts:
            for key in list(part.converted):
                tensor = part.converted.pop(key)
                copy_full_(state[_join(part.name, key)], tensor)
                part.checkpoint.release(tensor)
            setattr(part.module, INIT_REPORT_ATTR, part.report)
            setattr(part.module, '_is_init', True)  # noqa: B010  (mmengine's init flag)
            logger.info('%s: %d tensors of %s (%s) copied into the shards', part.name,
                        len(part.report.loaded), part.cfg['checkpoint'], part.report.layout)
        self.parts = []


def check_init_device(init_device: Optional[str], init_on_rank0: bool) -> None:
    """Refuse an ``init_device`` other than None / ``'meta'``, and both ways at once."""
    if init_device not in (None, 'meta'):
        raise ValueError(f"FSDP2Wrapper(init_device={init_device!r}): give 'meta' (every rank "
                         'builds on the meta device and loads its shards) or None')
    if init_device == 'meta' and init_on_rank0:
        raise ValueError("FSDP2Wrapper: init_device='meta' and init_on_rank0=True exclude each "
                         "other; init_device='meta' keeps no full copy on any rank")
