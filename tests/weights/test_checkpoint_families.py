"""Every family's checkpoint, in every layout of the table, given to every other backbone is
refused with a message naming the layout and the backbone that loads it (the full cross
product families x layouts x backbones).

The checkpoints are built as the loading tests build them (tests/weights/test_swin_weights.py,
test_swin_v2.py, test_vit_weights.py, test_official_vit_layouts.py,
test_vit_weights_detectron2.py, test_checkpoint_transformers.py): from tiny randomly
initialised reference models (timm, mmdet, transformers' save_pretrained files) and the
hand-written official layouts of those tests.
"""
import re
from functools import partial
from typing import Callable, Dict, Tuple

import pytest
import timm
import torch
from helpers import randomize_
from mmdet.models.backbones import SwinTransformer as MMDetSwin
from test_official_vit_layouts import dinov2_official, dinov3_official, eva02_official, tiny
from test_swin_v2 import _mmpretrain_from_timm, _official_from_timm
from test_swin_v2 import _ours as _swin_v2
from test_swin_v2 import _timm as _timm_swin_v2
from test_swin_weights import _official_from
from test_swin_weights import _ours as _swin
from test_checkpoint_transformers import HF_MODELS, saved_state_dict
from test_dfine_official import official as dfine_official
from test_dinov3_sta import deimv2_dinov3_reference
from test_hgnetv2 import TINY, TINY_HF, dfine_reference, perturb_
from test_hybrid_encoder import deimv2_hgnetv2_reference
from test_vit_weights import _mmpretrain_layout, _timm_vit, d2_checkpoint, sam_checkpoint, samvit
from test_vit_weights import ours as _vit
from test_vit_weights_detectron2 import _neck
from timm.models.swin_transformer import SwinTransformer as TimmSwin

import vitdet_plugin  # noqa: F401
from transformers import HGNetV2Backbone as HFHGNetV2, HGNetV2Config
from vitdet_plugin.models.backbones import (
    DINOv2Backbone,
    DINOv3Backbone,
    EVA02Backbone,
    HGNetV2Backbone,
    SwinBackbone,
    SwinV2Backbone,
    ViTBackbone,
)
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.weights import (LAYOUTS, CheckpointError, checkpoint_state_dict, detect_layout,
                                   layouts)
from vitdet_plugin.weights.layout import CLASS_NAMED, GENERIC, SPECIFIC
from vitdet_plugin.weights.transformers_layouts import TRANSFORMERS_MODELS
from vitdet_plugin.weights.vit import simple_fpn_to_detectron2

#: The patch-14 models of tests/weights/test_official_vit_layouts.py are built for 56 px (a 4 x 4
#: grid), the patch-16 ones for 64 px.
IMG14, IMG16 = 56, 64
#: EVA-02's pretraining grid of its official rope tables (timm's 224 / 14).
EVA_REF = 16
TINY_VIT = dict(embed_dims=64, depth=2, num_heads=4, global_attn_indexes=(0, 1))

#: family -> (the backbone that loads it, as the message must name it; a tiny one of them).
BACKBONES: Dict[str, Tuple[str, Callable[[], torch.nn.Module]]] = {
    'Swin': ('SwinBackbone', lambda: SwinBackbone(
        arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)), out_indices=(0, 1))),
    'Swin V2': ('SwinV2Backbone', lambda: SwinV2Backbone(
        arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)), out_indices=(0, 1))),
    'ViT': ('ViTBackbone', lambda: ViTBackbone(
        arch=dict(embed_dims=64, depth=2, num_heads=4), global_attn_indexes=(1,))),
    'DINOv2': ('DINOv2Backbone', lambda: DINOv2Backbone(**TINY_VIT, arch='small',
                                                        num_reg_tokens=4, pretrain_img_size=IMG14)),
    'DINOv3': ('DINOv3Backbone', lambda: DINOv3Backbone(**TINY_VIT, arch='small')),
    'EVA-02': ('EVA02Backbone', lambda: EVA02Backbone(**TINY_VIT, arch='tiny',
                                                      pretrain_img_size=IMG14)),
}
#: The neck's family (its checkpoints, given to a backbone, name it too).
NECK = ('simple FPN', 'ViTSimpleFPN')
#: RF-DETR's detectors: their backbone part loads into DINOv2Backbone (the message names it).
RFDETR = ('RF-DETR', 'DINOv2')
#: D-FINE / DEIMv2 checkpoints (tests/models/backbones/test_hgnetv2.py, test_dinov3_sta.py,
#: tests/models/necks/test_hybrid_encoder.py load them): family -> the module the message names.
DETR_PARTS = {'HGNetV2': 'HGNetV2Backbone', 'D-FINE': 'HGNetV2Backbone',
              'DEIMv2': 'HGNetV2Backbone', 'DEIMv2 DINOv3': 'DINOv3STABackbone'}


def _rfdetr() -> dict:
    """An RF-DETR file's layout (tests/weights/test_rfdetr_checkpoint.py loads the real one):
    transformers' DINOv2 under backbone.0.encoder.encoder., a projector and a decoder key."""
    vit = {'backbone.0.encoder.encoder.' + k: v
           for k, v in saved_state_dict('Dinov2Model').items()}
    return {'model': {**vit, 'backbone.0.projector.stages.0.1.weight': torch.zeros(8),
                      'transformer.decoder.norm.weight': torch.zeros(8)}, 'args': {}}


def _eva02_det() -> dict:
    """EVA-02/det's detector: its ViT (no cls token) under backbone.net., a pyramid, a head."""
    net = eva02_official(tiny('eva02_tiny_patch14_224', IMG14).state_dict(), grid=4,
                         ref_grid=EVA_REF, mim=False)
    net.pop('cls_token')
    det = {'backbone.net.' + k: v for k, v in net.items()}
    det['roi_heads.box_head.fc1.weight'] = torch.zeros(8, 8)
    return {'model': det}


def _mae() -> dict:
    sd = {k: v for k, v in _timm_vit().state_dict().items() if not k.startswith('head.')}
    sd.update(mask_token=torch.zeros(1, 1, 32), **{'decoder_embed.weight': torch.zeros(32, 64)})
    return {'model': sd}


def _timm_family(name: str, img_size: int, **kw) -> dict:
    """timm's own layout of a family model (classifier included, as timm saves it)."""
    return randomize_(timm.create_model(name, img_size=img_size, depth=2, embed_dim=64,
                                        num_heads=4, num_classes=5, **kw)).state_dict()


def _neck_detectron2() -> dict:
    neck = _neck()
    return {'backbone.' + k: v
            for k, v in simple_fpn_to_detectron2(neck.state_dict(), neck.scale_factors).items()}


#: (family, layout) -> a checkpoint in that layout.
CHECKPOINTS: Dict[Tuple[str, str], Callable[[], dict]] = {
    ('Swin', 'official'): lambda: _official_from(randomize_(_swin())),
    ('Swin', 'swin_od'): lambda: {'state_dict': {
        **{'backbone.' + k: v for k, v in randomize_(_swin()).state_dict().items()},
        'neck.lateral_convs.0.conv.weight': torch.zeros(8, 8, 1, 1)}},
    ('Swin', 'timm'): lambda: TimmSwin(embed_dim=32, depths=(2, 2, 2, 2),
                                       num_heads=(2, 2, 4, 4), num_classes=5).state_dict(),
    ('Swin', 'mmdet'): lambda: {'state_dict': randomize_(MMDetSwin(
        embed_dims=32, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1))).state_dict()},
    ('Swin', 'ours'): lambda: randomize_(_swin()).state_dict(),
    ('Swin V2', 'official'): lambda: {'model': _official_from_timm(_timm_swin_v2())},
    ('Swin V2', 'timm'): lambda: _timm_swin_v2().state_dict(),
    ('Swin V2', 'mmpretrain'): lambda: {'state_dict': _mmpretrain_from_timm(_timm_swin_v2())},
    ('Swin V2', 'ours'): lambda: randomize_(_swin_v2()).state_dict(),
    ('ViT', 'timm_vit'): lambda: _timm_vit().state_dict(),
    ('ViT', 'mae'): _mae,
    ('ViT', 'sam'): lambda: sam_checkpoint(samvit().state_dict()),
    ('ViT', 'timm_samvit'): lambda: samvit().state_dict(),
    ('ViT', 'detectron2'): lambda: d2_checkpoint(_vit(), _neck()),
    ('ViT', 'mmpretrain'): lambda: {'state_dict': _mmpretrain_layout(_timm_vit())},
    ('ViT', 'ours'): lambda: _vit().state_dict(),
    ('DINOv2', 'dinov2 official'): lambda: dinov2_official(
        tiny('vit_small_patch14_reg4_dinov2', IMG14).state_dict()),
    ('DINOv2', 'timm'): lambda: _timm_family('vit_small_patch14_reg4_dinov2', IMG14),
    ('DINOv2', 'ours'): lambda: randomize_(BACKBONES['DINOv2'][1]()).state_dict(),
    ('DINOv3', 'dinov3 official'): lambda: dinov3_official(
        tiny('vit_small_patch16_dinov3_qkvb', IMG16).state_dict()),
    ('DINOv3', 'timm'): lambda: _timm_family('vit_small_patch16_dinov3', IMG16),
    ('DINOv3', 'ours'): lambda: randomize_(BACKBONES['DINOv3'][1]()).state_dict(),
    ('EVA-02', 'eva02 official'): lambda: {'module': eva02_official(
        tiny('eva02_tiny_patch14_224', IMG14).state_dict(), grid=4, ref_grid=EVA_REF)},
    ('EVA-02', 'eva02_det official'): _eva02_det,
    ('EVA-02', 'timm'): lambda: _timm_family('eva02_tiny_patch14_224', IMG14),
    ('EVA-02', 'ours'): lambda: randomize_(BACKBONES['EVA-02'][1]()).state_dict(),
    (NECK[0], 'detectron2'): _neck_detectron2,
    (NECK[0], 'ours'): lambda: _neck().state_dict(),
    # transformers' save_pretrained files (tests/weights/test_checkpoint_transformers.py)
    **{(family, f'transformers {name}'): partial(saved_state_dict, name)
       for name, family in TRANSFORMERS_MODELS.items()},
    (RFDETR[0], 'rfdetr'): _rfdetr,
    ('HGNetV2', 'official'): lambda: randomize_(HGNetV2Backbone(arch=TINY)).state_dict(),
    ('HGNetV2', 'transformers HGNetV2'): lambda: perturb_(
        HFHGNetV2(HGNetV2Config(**TINY_HF))).state_dict(),
    ('D-FINE', 'transformers DFine'): lambda: dfine_reference().state_dict(),
    ('DEIMv2', 'transformers Deimv2'): lambda: deimv2_hgnetv2_reference(False).state_dict(),
    ('DEIMv2 DINOv3', 'transformers Deimv2 DINOv3'): lambda: deimv2_dinov3_reference(
        True).state_dict(),
    # the official repositories' files (tests/weights/test_dfine_official.py)
    ('D-FINE', 'official'): lambda: {'model': dfine_official('dfine_n')[0]},
    ('DEIMv2', 'official'): lambda: {'model': dfine_official('deimv2_atto')[0]},
    ('DEIMv2 DINOv3', 'official'): lambda: {'model': dfine_official('deimv2_s')[0]},
}
CASES = [(family, layout, receiver) for family, layout in CHECKPOINTS
         for receiver in BACKBONES if receiver != family
         and (family, receiver) != RFDETR]  # its backbone part loads there


def test_the_cross_product_covers_every_layout_of_the_table():
    assert set(CHECKPOINTS) == {(layout.family, layout.name) for layout in LAYOUTS}
    assert {layout.family for layout in LAYOUTS} == (set(BACKBONES) | {NECK[0], RFDETR[0]}
                                                     | set(DETR_PARTS))
    assert len(CASES) == (142 + 5 * len(HF_MODELS) + 5 + len(BACKBONES) * len(DETR_PARTS) + 6
                          + 3 * len(BACKBONES))


@pytest.fixture(scope='module')
def checkpoints() -> Dict[Tuple[str, str], dict]:
    built = {key: make() for key, make in CHECKPOINTS.items()}
    for (family, layout), ckpt in built.items():  # each is the layout it stands for
        found = detect_layout(checkpoint_state_dict(ckpt))
        assert (found.family, found.name) == (family, layout)
    return built


@pytest.fixture(scope='module')
def receivers() -> Dict[str, torch.nn.Module]:
    return {family: make() for family, (_, make) in BACKBONES.items()}


def _article(family: str) -> str:
    return 'an' if family in ('EVA-02', RFDETR[0]) else 'a'


@pytest.mark.parametrize('family,layout,receiver', CASES,
                         ids=[f'{f}-{lay}-into-{r}'.replace(' ', '_') for f, lay, r in CASES])
def test_a_checkpoint_of_another_family_is_refused_naming_the_backbone(
        checkpoints, receivers, family, layout, receiver):
    model = receivers[receiver]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    owner = BACKBONES[receiver][0]
    loads = (BACKBONES[family][0] if family in BACKBONES
             else BACKBONES[RFDETR[1]][0] if family == RFDETR[0]
             else DETR_PARTS.get(family, NECK[1]))
    want = (f'the checkpoint is {_article(family)} {family} checkpoint ({layout} layout); '
            f"{owner} loads {receiver} checkpoints: build type='{loads}'")
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        load_pretrained(model, checkpoints[(family, layout)])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded


#: The layouts each real checkpoint fits besides its own, all of a lower priority: a
#: transformers class fits its family's reference layout, a ViT family the plain ViT's.
ALSO_FITS = {('Swin V2', 'transformers Swinv2Model'): {('Swin V2', 'official')},
             ('DINOv2', 'dinov2 official'): {('ViT', 'mae')},
             ('DINOv2', 'timm'): {('ViT', 'timm_vit')}, ('DINOv2', 'ours'): {('ViT', 'timm_vit')},
             ('DINOv3', 'dinov3 official'): {('ViT', 'mae')},
             ('DINOv3', 'timm'): {('ViT', 'timm_vit')}, ('DINOv3', 'ours'): {('ViT', 'timm_vit')},
             ('EVA-02', 'eva02 official'): {('ViT', 'mae')},
             ('EVA-02', 'eva02_det official'): {('ViT', 'detectron2')},
             ('EVA-02', 'timm'): {('ViT', 'timm_vit')}, ('EVA-02', 'ours'): {('ViT', 'timm_vit')},
             ('D-FINE', 'official'): {('HGNetV2', 'official')},
             ('DEIMv2', 'official'): {('HGNetV2', 'official')}}


def test_detection_asks_every_layout_and_the_stated_priority_decides(checkpoints):
    """Every layout is asked (the table's order plays no part): each real checkpoint fits its
    own layout and, at most, layouts of a lower priority (:data:`ALSO_FITS`)."""
    assert {layout.priority for layout in LAYOUTS} == {CLASS_NAMED, SPECIFIC, GENERIC}
    for key, ckpt in checkpoints.items():
        sd = checkpoint_state_dict(ckpt)
        fits = {(layout.family, layout.name): layout for layout in layouts.matching_layouts(sd)}
        assert set(fits) == {key} | ALSO_FITS.get(key, set()), key
        assert all(fits[other].priority < fits[key].priority for other in ALSO_FITS.get(key, ()))


def test_the_result_does_not_depend_on_the_order_of_the_table(checkpoints, monkeypatch):
    monkeypatch.setattr(layouts, 'LAYOUTS', tuple(reversed(LAYOUTS)))
    for key, ckpt in checkpoints.items():
        found = detect_layout(checkpoint_state_dict(ckpt))
        assert (found.family, found.name) == key


def test_a_checkpoint_that_fits_two_layouts_alike_is_refused(checkpoints):
    """A timm Swin and a timm DINOv2 in one state dict: both layouts fit with the same priority;
    the loader refuses rather than pick one."""
    mixed = {**checkpoint_state_dict(checkpoints[('Swin', 'timm')]),
             **checkpoint_state_dict(checkpoints[('DINOv2', 'timm')])}
    want = ('the checkpoint fits 2 layouts alike: a DINOv2 checkpoint (timm layout), a Swin '
            'checkpoint (timm layout); it mixes the weights of several models: give the prefix '
            'of the one to load (init_cfg prefix=..., tools/convert_weights.py --prefix)')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        detect_layout(mixed)
