"""The compared models, holding the same weights, built through public APIs only.

A reference (timm) model is created with random weights, perturbed so that norms and
relative-position tables do real work, and loaded into ours through the plugin's checkpoint
loader (``load_pretrained``, through the layout table); mmdet's Swin gets ours converted
by ``swin_to_mmdet``, its architecture read off the converted weights.
"""
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .plan import Size

#: Standard deviation of the noise added to every reference weight (non-trivial norms,
#: relative-position tables and biases, so both models do all of the work).
PERTURB_STD = 0.02
#: Input size ViTDet / SAM models are built for (their position grid: 1024 / 16 = 64).
VIT_IMG_SIZE = 1024

Features = Callable[[Tensor], List[Tensor]]


@dataclass
class Compared:
    """Models to compare, ``'ours'`` first, and how to get each one's feature maps."""

    models: Dict[str, nn.Module]
    features: Dict[str, Features]
    parity_ref: str  # the reference whose last feature map ours must reproduce
    # input sizes where it must (None: all); elsewhere the difference is only recorded
    parity_sizes: Optional[Tuple[Size, ...]] = None


def feature_list(out: Union[Tensor, List[Tensor], tuple]) -> List[Tensor]:
    return [out] if isinstance(out, Tensor) else list(out)


def _features_of(model: nn.Module) -> Features:
    """``model``'s outputs as a list of feature maps."""
    def features(x: Tensor) -> List[Tensor]:
        return feature_list(model(x))
    return features


def _perturb_(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB_STD)


def _import_plugin() -> None:
    try:
        import vitdet_plugin  # noqa: F401  (registers our modules, checks the stack)
    except ModuleNotFoundError as e:
        raise SystemExit(f'the benchmark needs the plugin installed ({e}): run `make env` '
                         '(or `pip install -e .`) first') from e


class TimmSwinFeatures(nn.Module):
    """timm's swin returning per-stage NCHW features (like a detection backbone)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model: Any = model  # timm's SwinTransformer (patch_embed, layers)

    def forward(self, x: Tensor) -> List[Tensor]:
        x = self.model.patch_embed(x)
        outs = []
        for layer in self.model.layers:
            x = layer(x)
            outs.append(x.permute(0, 3, 1, 2))
        return outs


def mmdet_swin_spec(sd: Mapping[str, Tensor]) -> dict:
    """``SwinTransformer`` arguments (embed dims, depths, heads, window) of an mmdet-layout
    Swin state dict, read off its weights."""
    block = re.compile(r'^stages\.(\d+)\.blocks\.(\d+)\.')
    depths: Dict[int, int] = {}
    for key in sd:
        m = block.match(key)
        if m:
            stage, index = int(m.group(1)), int(m.group(2))
            depths[stage] = max(depths.get(stage, 0), index + 1)
    stages = sorted(depths)
    tables = [sd[f'stages.{i}.blocks.0.attn.w_msa.relative_position_bias_table'] for i in stages]
    side = math.isqrt(tables[0].shape[0])  # (2w - 1)^2 offsets of a square window
    return dict(embed_dims=sd['patch_embed.projection.weight'].shape[0],
                depths=tuple(depths[i] for i in stages),
                num_heads=tuple(t.shape[1] for t in tables), window_size=(side + 1) // 2)


def build_swin(arch: str, size: Size, with_cp: bool) -> Compared:
    """Ours, mmdet's ``SwinTransformer`` and timm's swin (``swin_{arch}_patch4_window7_224``)
    with the same weights; timm with gradient checkpointing when ``with_cp``."""
    import timm
    from mmdet.models.backbones import SwinTransformer
    _import_plugin()
    from vitdet_plugin.models.backbones import SwinBackbone
    from vitdet_plugin.weights import load_pretrained
    from vitdet_plugin.weights.swin import swin_to_mmdet

    # always_partition: keep the 7x7 windows (and their shift) in stages smaller than a
    # window, as mmdet and ours do; timm would shrink them (and the bias tables with them)
    tm: Any = timm.create_model(f'swin_{arch}_patch4_window7_224', pretrained=False, num_classes=0,
                           img_size=size, strict_img_size=False, always_partition=True,
                           drop_path_rate=0.0)
    _perturb_(tm)
    tm.set_grad_checkpointing(with_cp)
    ours = SwinBackbone(arch=arch, drop_path_rate=0.0, with_cp=with_cp)
    ours.init_weights()  # output norms, which timm's classifier does not have
    load_pretrained(ours, tm.state_dict())
    mm_sd = swin_to_mmdet(ours.state_dict())
    mm = SwinTransformer(**mmdet_swin_spec(mm_sd), drop_path_rate=0.0, with_cp=with_cp)
    mm.load_state_dict(mm_sd)
    timm_feats = TimmSwinFeatures(tm)
    models: Dict[str, nn.Module] = {'ours': ours, 'mmdet': mm, 'timm': timm_feats}
    features: Dict[str, Features] = {name: _features_of(m) for name, m in models.items()}
    return Compared(models=models, features=features, parity_ref='mmdet')


def build_vit(arch: str, with_cp: bool) -> Compared:
    """Our ViT and timm's ``samvit_{arch}_patch16`` (SAM's image encoder, 1024 input) with the
    same weights. timm's features are taken before its neck, so both run the same blocks."""
    import timm
    _import_plugin()
    from vitdet_plugin.models.backbones import ViTBackbone
    from vitdet_plugin.weights import load_pretrained

    ref: Any = timm.create_model(f'samvit_{arch}_patch16', pretrained=False, num_classes=0,
                            drop_path_rate=0.0)
    _perturb_(ref)
    ref.set_grad_checkpointing(with_cp)
    ours = ViTBackbone(arch=arch, img_size=VIT_IMG_SIZE, pretrain_img_size=VIT_IMG_SIZE,
                       pretrain_use_cls_token=False, drop_path_rate=0.0, with_cp=with_cp)
    load_pretrained(ours, ref.state_dict())
    last = len(ref.blocks) - 1

    def timm_features(x: Tensor) -> List[Tensor]:
        return feature_list(ref.forward_intermediates(x, indices=[last],
                                                      intermediates_only=True))

    features: Dict[str, Features] = {'ours': lambda x: feature_list(ours(x)),
                                     'timm': timm_features}
    # At other sizes the two resize the position embedding / relative-position tables
    # differently (measured ~2e-2 relative at 64-448 px, 6e-6 at 1024): recorded, not fatal.
    return Compared(models={'ours': ours, 'timm': ref}, features=features, parity_ref='timm',
                    parity_sizes=((VIT_IMG_SIZE, VIT_IMG_SIZE), ))


#: Window of the compared Swin V2 models (timm ``swinv2_{arch}_window8_256``).
SWINV2_WINDOW = 8
#: Total stride of the last of the four Swin V2 stages.
SWINV2_LAST_STRIDE = 32


def build_swinv2(arch: str, size: Size, with_cp: bool) -> Compared:
    """Our ``SwinV2Backbone`` and timm's ``swinv2_{arch}_window8_256`` with the same weights
    (loaded through ``load_pretrained``; our last output norm takes timm's final norm,
    so the last maps match). Both pad to whole windows, but timm rolls before padding and ours
    after (detection semantics): they compute the same function only where every stage's map
    is a multiple of the window (e.g. 256, 512, 1024; not 224 or 800x1216), so parity is
    enforced there and recorded elsewhere."""
    import timm
    _import_plugin()
    from vitdet_plugin.models.backbones import SwinV2Backbone
    from vitdet_plugin.weights import load_pretrained

    tm: Any = timm.create_model(f'swinv2_{arch}_window{SWINV2_WINDOW}_256', pretrained=False,
                           num_classes=0, img_size=size, strict_img_size=False,
                           always_partition=True, drop_path_rate=0.0)
    _perturb_(tm)
    tm.set_grad_checkpointing(with_cp)
    ours = SwinV2Backbone(arch=arch, window_size=SWINV2_WINDOW, drop_path_rate=0.0,
                          with_cp=with_cp)
    ours.init_weights()  # output norms of stages 0-2, which timm's classifier does not have
    load_pretrained(ours, tm.state_dict())
    last = ours.out_indices[-1]
    getattr(ours, f'norm{last}').load_state_dict(tm.norm.state_dict())
    timm_stages = TimmSwinFeatures(tm)

    def timm_features(x: Tensor) -> List[Tensor]:
        outs = timm_stages(x)
        return outs[:-1] + [tm.norm(outs[-1].permute(0, 2, 3, 1)).permute(0, 3, 1, 2)]

    aligned = all(s % (SWINV2_WINDOW * SWINV2_LAST_STRIDE) == 0 for s in size)
    return Compared(models={'ours': ours, 'timm': timm_stages},
                    features={'ours': lambda x: feature_list(ours(x)), 'timm': timm_features},
                    parity_ref='timm', parity_sizes=(size, ) if aligned else ())


#: timm model of each ViT family (``{arch}`` filled in) and our backbone type.
VIT_FAMILIES: Dict[str, Tuple[str, str]] = {
    'dinov2': ('vit_{arch}_patch14_reg4_dinov2', 'DINOv2Backbone'),
    'dinov3': ('vit_{arch}_patch16_dinov3', 'DINOv3Backbone'),
    'eva02': ('eva02_{arch}_patch14_224', 'EVA02Backbone'),
}
#: Patch size of the compared family models: the detection setting (a stride-16 map, a
#: 64 x 64 grid at 1024 px), DINOv2 / EVA-02 checkpoints resampled from 14.
FAMILY_PATCH = 16


def _registers(model: nn.Module) -> int:
    """Register tokens of a timm ViT / Eva (its ``reg_token`` parameter, if any)."""
    reg = getattr(model, 'reg_token', None)
    return 0 if reg is None else int(reg.shape[1])


def build_vit_family(family: str, arch: str, with_cp: bool) -> Compared:
    """timm's model of ``family`` (:data:`VIT_FAMILIES`, patch :data:`FAMILY_PATCH`, any input
    size) and ours with the same weights twice: ``'ours'`` with global attention in every block
    (the parity pair, timm's function) and ``'windowed'``, the detection configuration (window
    attention but in the family's ``global_attn_indexes``), so one row reports ours vs timm
    and global vs windowed."""
    import timm
    _import_plugin()
    from mmdet.registry import MODELS as MMDET_MODELS
    from vitdet_plugin.weights import load_pretrained

    timm_name, ours_type = VIT_FAMILIES[family]
    ref: Any = timm.create_model(timm_name.format(arch=arch), pretrained=False, num_classes=0,
                                 patch_size=FAMILY_PATCH, dynamic_img_size=True,
                                 drop_path_rate=0.0)
    _perturb_(ref)
    ref.set_grad_checkpointing(with_cp)
    depth = len(ref.blocks)
    grid = tuple(ref.patch_embed.grid_size)
    common = dict(type=ours_type, arch=arch, patch_size=FAMILY_PATCH, drop_path_rate=0.0,
                  with_cp=with_cp, num_reg_tokens=_registers(ref))
    if getattr(ref, 'pos_embed', None) is not None:  # timm's stored grid, at patch 16
        common.update(pretrain_img_size=tuple(g * FAMILY_PATCH for g in grid),
                      pretrain_patch_size=FAMILY_PATCH)
    ours = MMDET_MODELS.build(dict(common, global_attn_indexes=tuple(range(depth))))
    windowed = MMDET_MODELS.build(common)
    load_pretrained(ours, ref.state_dict())
    windowed.load_state_dict(ours.state_dict())
    norm = bool(ours.final_norm)

    def timm_features(x: Tensor) -> List[Tensor]:
        return feature_list(ref.forward_intermediates(x, indices=[depth - 1], norm=norm,
                                                      intermediates_only=True))

    features: Dict[str, Features] = {'ours': lambda x: feature_list(ours(x)),
                                     'timm': timm_features,
                                     'windowed': lambda x: feature_list(windowed(x))}
    return Compared(models={'ours': ours, 'timm': ref, 'windowed': windowed},
                    features=features, parity_ref='timm')


def build(model: str, arch: str, size: Size, with_cp: bool) -> Compared:
    if model == 'swin':
        return build_swin(arch, size, with_cp)
    if model == 'swinv2':
        return build_swinv2(arch, size, with_cp)
    if model == 'vit':
        return build_vit(arch, with_cp)
    if model in VIT_FAMILIES:
        return build_vit_family(model, arch, with_cp)
    raise ValueError(f'unknown model {model!r}; swin, swinv2, vit or one of '
                     f'{sorted(VIT_FAMILIES)}')
