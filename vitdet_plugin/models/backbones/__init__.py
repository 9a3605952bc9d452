"""Backbones; each declares the :class:`BackboneContract` (outputs, layer ids, no-decay names)."""
from .base import ArchSpec, BackboneContract, check_contract
from .dinov2 import DINOv2Backbone
from .dinov3 import DINOv3Backbone
from .dinov3_sta import DINOv3STABackbone, SpatialTuningAdapter
from .eva02 import EVA02Backbone
from .hgnetv2 import HGNetV2Arch, HGNetV2Backbone
from .plain_vit import PlainViTBackbone
from .swin import SwinBackbone
from .swin_archs import SwinArch, SwinV2Arch
from .swin_v2 import SwinV2Backbone
from .vit import ViTArch, ViTBackbone
from .vit_archs import PlainViTArch

__all__ = ['ArchSpec', 'BackboneContract', 'check_contract', 'SwinArch', 'SwinBackbone',
           'SwinV2Arch', 'SwinV2Backbone', 'ViTArch', 'ViTBackbone', 'PlainViTArch',
           'PlainViTBackbone', 'DINOv2Backbone', 'DINOv3Backbone', 'EVA02Backbone',
           'HGNetV2Arch', 'HGNetV2Backbone', 'DINOv3STABackbone', 'SpatialTuningAdapter']
