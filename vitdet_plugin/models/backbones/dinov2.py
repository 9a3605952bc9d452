"""DINOv2 (Oquab et al., 2023; with registers, Darcet et al., 2024) as a plain ViT backbone:
presets of timm 1.0.31's ``vit_*_patch14_dinov2``."""
import dataclasses
from typing import ClassVar, Optional

from mmdet.registry import MODELS

from .plain_vit import PlainViTBackbone, family_docs
from .vit_archs import DINO_LAYER_SCALE, PlainViTArch

#: DINOv2-giant's SwiGLU width (4096 for 1536 channels).
DINOV2_GIANT_MLP_RATIO = 2.66667


@dataclasses.dataclass(frozen=True)
class DINOv2Arch(PlainViTArch):
    """DINOv2 presets (``vit_{small,base,large,giant}_patch14_dinov2``; registers: give
    ``num_reg_tokens=4``); custom arch dicts default to DINOv2's block options."""

    layer_scale: Optional[float] = DINO_LAYER_SCALE

    NAME: ClassVar[str] = 'DINOv2'
    PRESETS: ClassVar = {
        'small': dict(embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
        'giant': dict(embed_dims=1536, depth=40, num_heads=24, mlp='swiglu_packed',
                      mlp_ratio=DINOV2_GIANT_MLP_RATIO, drop_path_rate=0.5),
    }


@MODELS.register_module()
@family_docs
class DINOv2Backbone(PlainViTBackbone):
    """DINOv2 (with registers: ``num_reg_tokens=4``): patch 14, position grid 518 / 14 = 37,
    LayerScale, fused qkv bias; no rotary embedding. Presets: small / base / large / giant."""

    ARCH = DINOv2Arch
    FAMILY = 'DINOv2'
    DEFAULT_PATCH = 14
    DEFAULT_PRETRAIN_IMG = 518
    ROPE = None
