"""DINOv3 (Simeoni et al., 2025) as a plain ViT backbone: presets of timm 1.0.31's
``vit_*_patch16_dinov3``; the 7B one trains sharded across GPUs (docs/large_models.md)."""
import dataclasses
from typing import ClassVar, Mapping, Optional

from mmdet.registry import MODELS

from .plain_vit import PlainViTBackbone, family_docs
from .vit_archs import DINO_LAYER_SCALE, PlainViTArch

#: DINOv3's LayerNorm eps.
EPS_DINOV3 = 1e-5
#: DINOv3 S+ / H+ round their SwiGLU width up to a multiple of this.
DINOV3_MLP_ALIGN = 8
#: DINOv3 7B (``ffn_ratio=3, ffn_layer='swiglu64'``): SwiGLU width 2 x 4096, a multiple of 64.
DINOV3_7B_MLP_RATIO = 2.0
DINOV3_7B_MLP_ALIGN = 64
_DINOV3_SWIGLU = dict(mlp='swiglu', mlp_align=DINOV3_MLP_ALIGN)


@dataclasses.dataclass(frozen=True)
class DINOv3Arch(PlainViTArch):
    """DINOv3 presets (``vit_{small,small_plus,base,large,huge_plus,7b}_patch16_dinov3``; the
    ``*_qkvb`` checkpoints: give ``qkv_bias='qv'``); custom arch dicts default to DINOv3's
    block options."""

    qkv_bias: str = 'none'
    layer_scale: Optional[float] = DINO_LAYER_SCALE
    num_reg_tokens: int = 4
    norm_eps: float = EPS_DINOV3

    NAME: ClassVar[str] = 'DINOv3'
    PRESETS: ClassVar = {
        'small': dict(embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'small_plus': dict(_DINOV3_SWIGLU, embed_dims=384, depth=12, num_heads=6,
                           drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
        'huge_plus': dict(_DINOV3_SWIGLU, embed_dims=1280, depth=32, num_heads=20,
                          drop_path_rate=0.5),
        # its untied norm (local_cls_norm) is pretraining-only
        '7b': dict(mlp='swiglu', mlp_ratio=DINOV3_7B_MLP_RATIO, mlp_align=DINOV3_7B_MLP_ALIGN,
                   embed_dims=4096, depth=40, num_heads=32, drop_path_rate=0.5),
    }


@MODELS.register_module()
@family_docs
class DINOv3Backbone(PlainViTBackbone):
    """DINOv3: patch 16, 4 register tokens, DINOv3 rope (temperature 100, half rotation), no
    absolute position embedding, LayerScale; ``qkv_bias='qv'`` for the ``*_qkvb`` checkpoints.
    Presets: small / small_plus / base / large / huge_plus / 7b."""

    ARCH = DINOv3Arch
    FAMILY = 'DINOv3'
    DEFAULT_PATCH = 16
    USE_ABS_POS = False
    ROPE_FORMULATION = 'dinov3'
    ROPE: ClassVar[Optional[Mapping]] = {'temperature': 100.0}
