"""EVA-02 (Fang et al., 2023) as a plain ViT backbone: presets of timm 1.0.31's
``eva02_*_patch14_224``."""
import dataclasses
from typing import ClassVar, Mapping, Optional

from mmdet.registry import MODELS

from .plain_vit import PlainViTBackbone, family_docs
from .vit_archs import PlainViTArch

#: EVA-02's SwiGLU width: 2/3 of the 4x GELU MLP (same parameter count).
EVA02_MLP_RATIO = 4 * 2 / 3
_EVA02_PACKED = dict(mlp='swiglu_packed', mlp_sub_ln=False)


@dataclasses.dataclass(frozen=True)
class EVA02Arch(PlainViTArch):
    """EVA-02 presets (``eva02_{tiny,small,base,large}_patch14_224``): packed SwiGLU for T/S,
    SwiGLU with sub-LN for B/L; q and v biases. Custom arch dicts default to B / L's block
    options."""

    mlp: str = 'swiglu'
    mlp_ratio: float = EVA02_MLP_RATIO
    mlp_sub_ln: bool = True
    qkv_bias: str = 'qv'

    NAME: ClassVar[str] = 'EVA-02'
    PRESETS: ClassVar = {
        'tiny': dict(_EVA02_PACKED, embed_dims=192, depth=12, num_heads=3, drop_path_rate=0.1),
        'small': dict(_EVA02_PACKED, embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
    }


@MODELS.register_module()
@family_docs
class EVA02Backbone(PlainViTBackbone):
    """EVA-02: patch 14, position grid 224 / 14 = 16, EVA-02 rope (temperature 1e4 on the 16 x
    16 pretraining grid, interleaved pairs), q / v biases, SwiGLU (sub-LN for B / L); window 16
    as EVA-02-det. Presets: tiny / small / base / large."""

    ARCH = EVA02Arch
    FAMILY = 'EVA-02'
    DEFAULT_PATCH = 14
    DEFAULT_WINDOW = 16
    ROPE_FORMULATION = 'eva02'
    FINAL_NORM = False  # EVA-02-det has none, timm's EVA-02 normalises after pooling only
    ROPE: ClassVar[Optional[Mapping]] = {'temperature': 10000.0, 'ref_grid': (16, 16)}
