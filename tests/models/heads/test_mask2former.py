"""Mask2Former (mmdet 3.3) with our backbones: configs/swin_mask2former_instance.py,
configs/swin_mask2former_panoptic.py and configs/vit_mask2former_panoptic.py.

Each config's model, shrunk in size only (backbone, pixel decoder, transformer decoder, queries,
sampled points), takes one loss step and one prediction step on CPU; the semantic output of
SemanticMaskFormerFusionHead is checked on a hand-computed example and reaches mmdet's
SemSegMetric; the optimizer wrappers give no weight decay to the backbone's norms, biases and
tables. The pixel decoder's MultiScaleDeformableAttention runs mmcv's pure-PyTorch fallback on
CPU tensors (forward and backward), which the loss test records.
"""
import copy
import os.path as osp
from typing import Any, Dict, List, Set, Tuple
from unittest import mock

import mmcv.ops.multi_scale_deform_attn as msda
import numpy as np
import pytest
import torch
from mmdet.registry import METRICS, MODELS
from mmdet.structures import DetDataSample
from mmdet.structures.mask import BitmapMasks, mask2bbox
from mmengine.config import Config, ConfigDict
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope
from mmengine.structures import InstanceData, PixelData
from torch import Tensor, nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import load_config
from vitdet_plugin.models.heads import SemanticMaskFormerFusionHead, semantic_inference
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
SWIN_INSTANCE = 'swin_mask2former_instance.py'
SWIN_PANOPTIC = 'swin_mask2former_panoptic.py'
VIT_PANOPTIC = 'vit_mask2former_panoptic.py'
CONFIGS = [SWIN_INSTANCE, SWIN_PANOPTIC, VIT_PANOPTIC]
PANOPTIC = {SWIN_PANOPTIC, VIT_PANOPTIC}
STOCK_SWIN_PANOPTIC = 'mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco-panoptic.py'

#: (h, w) of the two test images: no multiple of 32, of the windows or of the patch sizes
IMAGE_SIZES = ((70, 100), (58, 90))
#: BatchFixedSizePad target (the stock 1024 x 1024 shrunk): the batch padded to multiples of 32
TINY_PAD = (96, 128)
IGNORE_INDEX = 255
LR, WD = 1e-4, 0.05
BACKBONE_LR_MULT = 0.1
# shrunk sizes (the architecture stays: 4 backbone levels, 3 deformable levels, masked attention
# over the 3 levels in turn)
TINY_FEAT = 32  # pixel decoder / transformer decoder channels (GN has 32 groups)
TINY_HEADS = 2
TINY_FFN = 64
TINY_QUERIES = 8
TINY_DECODER_LAYERS = 3  # one round over the 3 feature levels
TINY_ENCODER_LAYERS = 1
TINY_POINTS = 2  # deformable sampling points per head and level
TINY_MASK_POINTS = 256  # points sampled per mask for the mask / dice losses
TINY_SWIN = dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4,
                 drop_path_rate=0.0)
TINY_VIT = dict(embed_dims=64, depth=2, num_heads=2, global_attn_indexes=(1,), window_size=4,
                img_size=128, drop_path_rate=0.0)
TINY_PYRAMID_CHANNELS = 32


def _config(name: str) -> Config:
    return load_config(osp.join(ROOT, 'configs', name))


def _shrink(model_cfg: ConfigDict) -> ConfigDict:
    """Sizes only: backbone, pixel decoder, transformer decoder, queries, sampled points and
    the batch padding; the backbone's channels follow into the head."""
    cfg = copy.deepcopy(model_cfg)
    bb = cfg.backbone
    feeds_head = bb  # the backbone, or the ViT's simple-pyramid neck
    if bb.type == 'ViTBackbone':
        bb.update(TINY_VIT)
        cfg.neck.update(in_channels=TINY_VIT['embed_dims'], out_channels=TINY_PYRAMID_CHANNELS)
        feeds_head = cfg.neck
    else:
        bb.update(TINY_SWIN)
    bb.init_cfg = None
    cfg.panoptic_head.in_channels = list(MODELS.build(copy.deepcopy(feeds_head)).out_channels)
    for aug in cfg.data_preprocessor.get('batch_augments') or []:
        aug.size = TINY_PAD
    head = cfg.panoptic_head
    head.update(feat_channels=TINY_FEAT, out_channels=TINY_FEAT, num_queries=TINY_QUERIES)
    head.positional_encoding.num_feats = TINY_FEAT // 2
    decoder = head.pixel_decoder
    decoder.positional_encoding.num_feats = TINY_FEAT // 2
    decoder.encoder.num_layers = TINY_ENCODER_LAYERS
    decoder.encoder.layer_cfg.self_attn_cfg.update(embed_dims=TINY_FEAT, num_heads=TINY_HEADS,
                                                   num_points=TINY_POINTS)
    decoder.encoder.layer_cfg.ffn_cfg.update(embed_dims=TINY_FEAT,
                                             feedforward_channels=TINY_FFN)
    transformer = head.transformer_decoder
    transformer.num_layers = TINY_DECODER_LAYERS
    for key in ('self_attn_cfg', 'cross_attn_cfg'):
        transformer.layer_cfg[key].update(embed_dims=TINY_FEAT, num_heads=TINY_HEADS)
    transformer.layer_cfg.ffn_cfg.update(embed_dims=TINY_FEAT, feedforward_channels=TINY_FFN)
    cfg.train_cfg.num_points = TINY_MASK_POINTS
    return cfg


def _build(model_cfg: ConfigDict) -> Any:
    """The detector (typed Any: its heads' attributes are read)."""
    torch.manual_seed(0)
    model = MODELS.build(copy.deepcopy(model_cfg))
    model.init_weights()
    return model


def _sample(index: int, hw: Tuple[int, int], num_things: int, with_stuff: bool) -> DetDataSample:
    """Two thing instances (rectangles), and with stuff: a stuff band, the rest VOID."""
    h, w = hw
    masks = np.zeros((2, h, w), dtype=np.uint8)
    masks[0, 5:30, 10:50] = 1
    masks[1, 25 + index:h - 4, 40:w - 6] = 1
    masks[0] &= 1 - masks[1]  # panoptic segments do not overlap
    labels = torch.tensor([3 + index, 17])
    sample = DetDataSample(metainfo=dict(img_id=index, img_shape=hw, ori_shape=hw,
                                         scale_factor=(1.0, 1.0)))
    sample.gt_instances = InstanceData(
        labels=labels, masks=BitmapMasks(masks, h, w),
        bboxes=mask2bbox(torch.from_numpy(masks).bool()).float())
    if with_stuff:
        sem = torch.full((1, h, w), IGNORE_INDEX, dtype=torch.long)
        sem[0, h - 12:] = num_things + 5 + index           # a stuff class
        for mask, label in zip(masks, labels):
            sem[0][torch.from_numpy(mask).bool()] = label  # things on top
        sample.gt_sem_seg = PixelData(sem_seg=sem)
    return sample


def _batch(num_things: int, with_stuff: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        inputs=[torch.randint(0, 256, (3, *hw), generator=g, dtype=torch.uint8)
                for hw in IMAGE_SIZES],
        data_samples=[_sample(i, hw, num_things, with_stuff) for i, hw in enumerate(IMAGE_SIZES)])


def _loss_step(model: Any, num_things: int, with_stuff: bool) -> Dict[str, Tensor]:
    model.train()
    data = model.data_preprocessor(_batch(num_things, with_stuff), training=True)
    assert tuple(data['inputs'].shape[-2:]) == TINY_PAD
    losses = model.loss(data['inputs'], data['data_samples'])
    assert {'loss_cls', 'loss_mask', 'loss_dice'} <= set(losses)
    assert all(torch.isfinite(v).all() for v in losses.values()), losses
    sum(losses.values()).backward()
    grad = model.backbone.patch_embed.proj.weight.grad  # the first layer: through all blocks
    assert grad is not None and grad.abs().sum() > 0
    return losses


def _predict(model: Any, num_things: int, with_stuff: bool) -> List[DetDataSample]:
    model.eval()
    with torch.no_grad():
        data = model.data_preprocessor(_batch(num_things, with_stuff), training=False)
        return model.predict(data['inputs'], data['data_samples'])


@pytest.mark.parametrize('name', CONFIGS)
def test_config_loss_and_predict(name: str) -> None:
    cfg = _config(name)
    model_cfg = _shrink(cfg.model)
    model = _build(model_cfg)
    head = model.panoptic_head
    num_things, num_classes = head.num_things_classes, head.num_classes
    panoptic = name in PANOPTIC
    assert model.test_cfg.panoptic_on == model.test_cfg.semantic_on == panoptic
    assert head.num_stuff_classes == (53 if panoptic else 0)

    # MultiScaleDeformableAttention: mmcv's PyTorch version on CPU tensors, forward + backward
    with mock.patch.object(msda, 'multi_scale_deformable_attn_pytorch',
                           wraps=msda.multi_scale_deformable_attn_pytorch) as fallback:
        _loss_step(model, num_things, panoptic)
    assert fallback.call_count == TINY_ENCODER_LAYERS
    offsets = head.pixel_decoder.encoder.layers[0].self_attn.sampling_offsets.weight.grad
    assert offsets is not None and offsets.abs().sum() > 0

    results = _predict(model, num_things, panoptic)
    assert len(results) == len(IMAGE_SIZES)
    for result, hw in zip(results, IMAGE_SIZES):
        pred = result.pred_instances
        assert pred.masks.shape[1:] == hw and pred.masks.dtype == torch.bool
        assert len(pred.masks) == len(pred.labels) == len(pred.scores) > 0
        assert pred.labels.max() < num_things  # things only
        assert torch.isfinite(pred.scores).all()
        if not panoptic:
            assert 'pred_panoptic_seg' not in result and 'pred_sem_seg' not in result
            continue
        assert result.pred_panoptic_seg.sem_seg.shape == (1, *hw)
        sem = result.pred_sem_seg.sem_seg
        assert sem.shape == (1, *hw) and sem.dtype == torch.long
        assert 0 <= sem.min() and sem.max() < num_classes


@pytest.mark.parametrize('name', CONFIGS)
def test_full_size_backbone_feeds_the_pixel_decoder(name: str) -> None:
    """At the config's own size: four maps at strides 4 / 8 / 16 / 32 with the channels the
    head's pixel decoder is built for. Built on the meta device: only the contract is read,
    no full-size weights are allocated or initialised."""
    model_cfg = _config(name).model
    with torch.device('meta'):
        backbone = MODELS.build(dict(copy.deepcopy(model_cfg.backbone), init_cfg=None))
        feeds_head = backbone
        if model_cfg.get('neck') is not None:  # the ViT's simple pyramid reads its one map
            feeds_head = MODELS.build(copy.deepcopy(model_cfg.neck))
            assert (feeds_head.in_channels, feeds_head.in_stride) == (
                backbone.out_channels[-1], backbone.out_strides[-1])
    assert list(feeds_head.out_strides) == list(model_cfg.panoptic_head.strides) == [4, 8, 16, 32]
    assert list(feeds_head.out_channels) == list(model_cfg.panoptic_head.in_channels)


def test_semantic_map_reaches_semsegmetric() -> None:
    """The panoptic config's pred_sem_seg matches the unpadded ground truth's shape and the
    config's SemSegMetric turns it into mIoU."""
    cfg = _config(SWIN_PANOPTIC)
    model = _build(_shrink(cfg.model))
    num_things, num_classes = model.panoptic_head.num_things_classes, model.num_classes
    results = _predict(model, num_things, with_stuff=True)
    metric_cfg = next(m for m in cfg.val_evaluator if m.type == 'SemSegMetric')
    metric = METRICS.build(metric_cfg)
    metric.dataset_meta = dict(classes=[f'class{i}' for i in range(num_classes)])
    metric.process({}, [r.to_dict() for r in results])
    scores = metric.evaluate(len(results))
    assert {'aAcc', 'mIoU'} <= set(scores)
    assert 0.0 <= scores['aAcc'] <= 100.0 and 0.0 <= scores['mIoU'] <= 100.0


def test_panoptic_configs_evaluate_panoptic_instance_and_semantic() -> None:
    for name in PANOPTIC:
        cfg = _config(name)
        assert cfg.model.panoptic_fusion_head.type == 'SemanticMaskFormerFusionHead'
        assert cfg.model.test_cfg.instance_on and cfg.model.test_cfg.semantic_on
        for key in ('val_evaluator', 'test_evaluator'):
            types = [m.type for m in cfg[key]]
            assert types == ['CocoPanopticMetric', 'CocoMetric', 'SemSegMetric'], (name, types)
            assert 'segm' in cfg[key][1].metric
    instance = _config(SWIN_INSTANCE)
    assert instance.model.test_cfg.instance_on and not instance.model.test_cfg.semantic_on
    assert instance.val_evaluator.type == 'CocoMetric'


def test_panoptic_data_root_override_reaches_every_evaluator(tmp_path) -> None:
    """One data_root override moves the datasets and every path of the evaluator list
    (panoptic json + PNG folder, instances json); the SemSegMetric reads no file."""
    new = str(tmp_path / 'coco') + '/'
    for name in PANOPTIC:
        old = _config(name).data_root
        moved = load_config(osp.join(ROOT, 'configs', name), {'data_root': new})
        paths = [m.get(key) for m in moved.val_evaluator for key in ('ann_file', 'seg_prefix')
                 if m.get(key)]
        assert len(paths) == 3 and all(p.startswith(new) for p in paths), paths
        for stage in ('train', 'val', 'test'):
            assert moved[f'{stage}_dataloader'].dataset.data_root == new
        assert old not in str(moved.val_evaluator) + str(moved.test_evaluator)


# ------------------------------------------------------------------ semantic inference
#: 2 queries over 3 classes (+ no-object), as probabilities; softmax(log p) = p
CLASS_PROBS = torch.tensor([[0.40, 0.05, 0.35, 0.20],
                            [0.05, 0.40, 0.35, 0.20]])
#: sigmoid of the two 2x2 mask logits
MASK_PROBS = torch.tensor([[[0.95, 0.05], [0.90, 0.05]],
                           [[0.05, 0.95], [0.90, 0.50]]])
#: sum_q p_qc * m_qhw by hand, e.g. class 2 at (1, 0): 0.35 * 0.9 + 0.35 * 0.9 = 0.63
SEMANTIC_SCORES = torch.tensor([[[0.3825, 0.0675], [0.4050, 0.0450]],
                                [[0.0675, 0.3825], [0.4050, 0.2025]],
                                [[0.3500, 0.3500], [0.6300, 0.1925]]])
#: class 2 wins at (1, 0) although neither query's own best class is 2
SEMANTIC_MAP = torch.tensor([[[0, 1], [2, 1]]])


def _logits() -> Tuple[Tensor, Tensor]:
    return CLASS_PROBS.log(), torch.logit(MASK_PROBS)


def test_semantic_inference_by_hand() -> None:
    cls_logits, mask_logits = _logits()
    scores = semantic_inference(cls_logits, mask_logits)
    torch.testing.assert_close(scores, SEMANTIC_SCORES, rtol=0, atol=1e-6)
    head = SemanticMaskFormerFusionHead(num_things_classes=2, num_stuff_classes=1)
    torch.testing.assert_close(head.semantic_postprocess(cls_logits, mask_logits).sem_seg,
                               SEMANTIC_MAP)
    with pytest.raises(ValueError, match='expected'):
        semantic_inference(cls_logits[0], mask_logits)


def test_fusion_head_crops_padding_and_rescales() -> None:
    cls_logits, mask_logits = _logits()
    padded = torch.full((2, 3, 4), 50.0)  # padding that would win every pixel if read
    padded[:, :2, :2] = mask_logits
    cfg = dict(panoptic_on=True, instance_on=True, semantic_on=True, max_per_image=4)
    head = SemanticMaskFormerFusionHead(num_things_classes=2, num_stuff_classes=1,
                                        test_cfg=cfg)
    sample = DetDataSample(metainfo=dict(img_shape=(2, 2), ori_shape=(4, 6)))
    out = head.predict(cls_logits[None], padded[None], [sample], rescale=False)
    assert set(out[0]) == {'pan_results', 'ins_results'}  # mmdet's MaskFormer rejects others
    torch.testing.assert_close(sample.pred_sem_seg.sem_seg, SEMANTIC_MAP)
    head.predict(cls_logits[None], padded[None], [sample], rescale=True)
    assert sample.pred_sem_seg.sem_seg.shape == (1, 4, 6)
    assert out[0]['pan_results'].sem_seg.shape == (1, 2, 2)


def test_mmdet_fusion_head_has_no_semantic_output() -> None:
    """Why the panoptic configs use our head: mmdet 3.3's refuses semantic_on."""
    from mmdet.models.seg_heads import MaskFormerFusionHead
    cls_logits, mask_logits = _logits()
    stock = MaskFormerFusionHead(num_things_classes=2, num_stuff_classes=1,
                                 test_cfg=dict(semantic_on=True))
    sample = DetDataSample(metainfo=dict(img_shape=(2, 2), ori_shape=(2, 2)))
    with pytest.raises(AssertionError, match='not supported'):
        stock.predict(cls_logits[None], mask_logits[None], [sample])
    with pytest.raises(NotImplementedError):
        stock.semantic_postprocess(cls_logits, mask_logits)


# ------------------------------------------------------------------ optimizer wrappers
def _independent_no_decay(backbone: nn.Module) -> Set[str]:
    """Norm parameters, biases and position tables of the backbone, found from module types
    (not from the backbone's own no_weight_decay())."""
    tables = {'relative_position_bias_table', 'absolute_pos_embed', 'pos_embed', 'rel_pos_h',
              'rel_pos_w'}
    names = set()
    for mod_name, module in backbone.named_modules():
        norm = isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or 'Norm' in type(module).__name__
        for p_name, _ in module.named_parameters(recurse=False):
            if norm or p_name == 'bias' or p_name in tables:
                names.add(f'backbone.{mod_name}.{p_name}' if mod_name else f'backbone.{p_name}')
    return names


def _groups(model: nn.Module, optim_cfg: ConfigDict) -> Dict[str, Tuple[float, float]]:
    """Parameter name -> (lr, weight decay) of the built optimizer."""
    wrapper = build_optim_wrapper(model, copy.deepcopy(optim_cfg))
    names = {id(p): n for n, p in model.named_parameters()}
    table = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            table[names[id(p)]] = (group['lr'], group['weight_decay'])
    assert set(table) == set(names.values())
    return table


@pytest.mark.parametrize('name', CONFIGS)
def test_optim_wrapper_no_decay_on_backbone_norms_biases_tables(name: str) -> None:
    cfg = _config(name)
    model = _build(_shrink(cfg.model))
    expected = _independent_no_decay(model.backbone)
    table = _groups(model, cfg.optim_wrapper)
    backbone = {n: v for n, v in table.items() if n.startswith('backbone.')}
    no_decay = {n for n, (_, wd) in backbone.items() if wd == 0.0}
    assert no_decay == expected
    assert len(no_decay) == len(model.backbone.no_weight_decay())
    decayed = [wd for _, wd in backbone.values() if wd != 0.0]
    assert decayed and set(decayed) == {WD}  # every other backbone weight
    for key in ('query_embed', 'query_feat', 'level_embed'):
        wd = table[f'panoptic_head.{key}.weight'][1]
        assert wd == 0.0, (key, wd)  # stock: custom_keys; ViT: extra_no_decay_names
    if name == VIT_PANOPTIC:  # layer decay: the patch embedding learns slowest, blocks faster
        patch = table['backbone.patch_embed.proj.weight'][0]
        block = table['backbone.blocks.1.mlp.fc1.weight'][0]
        assert patch < block < LR and table['neck.lateral_convs.0.conv.weight'][0] == LR
    else:
        assert all(lr == pytest.approx(LR * BACKBONE_LR_MULT) for lr, _ in backbone.values())


# ------------------------------------------------------------------ the stock mmdet config
def test_stock_mmdet_mask2former_with_our_swin() -> None:
    """mmdet's own Swin Mask2Former panoptic config with only the backbone type changed (no
    pretrained download, sizes shrunk) trains a step; its custom_keys, written for mmdet's
    parameter names, leave weight decay on our backbone's norms (the reason for the
    NoDecayOptimWrapperConstructor in our configs)."""
    import mmdet
    cfg = Config.fromfile(osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs',
                                   STOCK_SWIN_PANOPTIC))
    init_default_scope('mmdet')
    assert cfg.model.backbone.type == 'SwinTransformer'
    cfg.model.backbone.type = 'SwinBackbone'
    model = _build(_shrink(cfg.model))
    assert type(model.backbone).__name__ == 'SwinBackbone'
    _loss_step(model, model.panoptic_head.num_things_classes, with_stuff=True)
    table = _groups(model, cfg.optim_wrapper)
    block_norms = [n for n in _independent_no_decay(model.backbone)
                   if '.blocks.' in n and 'norm' in n]
    assert block_norms and all(table[n][1] == WD for n in block_norms)
