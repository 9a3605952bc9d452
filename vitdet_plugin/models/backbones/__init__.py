"""Backbones; each declares the :class:`BackboneContract` (outputs, layer ids, no-decay names)."""
from .archs import SwinArch, ViTArch
from .base import ArchSpec, BackboneContract, check_contract
from .plain_vit import DINOv2Backbone, DINOv3Backbone, EVA02Backbone, PlainViTBackbone
from .swin import SwinBackbone
from .swin_v2 import SwinV2Arch, SwinV2Backbone
from .vit import ViTBackbone

__all__ = ['ArchSpec', 'BackboneContract', 'check_contract', 'SwinArch', 'SwinBackbone',
           'SwinV2Arch', 'SwinV2Backbone', 'ViTArch', 'ViTBackbone',
           'PlainViTBackbone', 'DINOv2Backbone', 'DINOv3Backbone', 'EVA02Backbone']
