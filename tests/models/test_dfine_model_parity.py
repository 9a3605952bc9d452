"""Whole D-FINE / DEIMv2 detectors (mmdet ``SingleStageDetector`` + ``DFineHead``) against
transformers 5's ``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` on the same weights:
tiny random references (every parameter and statistic perturbed, fp32, eval) saved with
``save_pretrained``, our detector built from the same config and loaded from the folder through
:func:`~vitdet_plugin.weights.dfine_detector.dfine_to_detector`.

Limits: backbone and encoder outputs <= 1e-5 relative; every decoder layer's logits / boxes
<= 1e-4; mmdet ``predict`` = transformers' ``post_process_object_detection`` (labels equal,
scores <= 1e-4, boxes <= 1e-3 of the side, transformers' boxes clipped to the image as mmdet's
are). One training step: our head's losses equal :class:`DFineCriterion` on the authors'
prediction sets of transformers' outputs (same denoising draws), and so do the gradients.
"""
import copy
from typing import Dict, List, Tuple

import pytest
import torch
from helpers import assert_close_rel, load_tool
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmengine.structures import InstanceData
from test_dinov3_sta import TINY_DEIMV2, TINY_VIT, TINY_VIT_HF
from test_hgnetv2 import TINY, TINY_DFINE, TINY_HF, perturb_
from transformers import (DFineConfig, DFineForObjectDetection, Deimv2Config,
                          Deimv2ForObjectDetection, DINOv3ViTConfig, HGNetV2Config,
                          RTDetrImageProcessor)

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.heads.dfine_decoder import DFineDecoderOutput
from vitdet_plugin.models.losses import DFineCriterion, dfine_prediction_sets
from vitdet_plugin.weights import CheckpointError
from vitdet_plugin.weights.dfine_detector import dfine_to_detector
from vitdet_plugin.weights.dfine_keys import dfine_head_state_dict

#: decoder outputs (fp32) agree to this; backbone / encoder maps to 1e-5 relative.
LAYER_TOL = 1e-4
SCORE_TOL = 1e-4
#: box error as a fraction of the image side.
BOX_SIDE_TOL = 1e-3
SIZES = ((64, 64), (64, 96))
#: D-FINE's pixels: RGB / 255; DEIMv2 over DINOv3: ImageNet's mean / std.
DFINE_PRE = dict(type='DetDataPreprocessor', mean=[0.0] * 3, std=[255.0] * 3, bgr_to_rgb=True)
IMAGENET = dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                std=[58.395, 57.12, 57.375], bgr_to_rgb=True)
#: A second D-FINE size: decoder wider than the encoder (conv input projections), 3 layers,
#: another point count per level, 12 queries.
DFINE_WIDE = dict(d_model=48, decoder_ffn_dim=96, decoder_layers=3, num_queries=12,
                  decoder_n_points=[3, 2, 4], num_labels=4)
#: the decoder's constants (its bins' ``up`` / ``reg_scale``, the points' scale): not weights.
CONSTANTS = ('decoder.up', 'decoder.reg_scale', 'num_points_scale')
HYBRID = dict(type='HybridEncoder', hidden_dim=32, num_heads=4, ffn_dim=64, expansion=0.5,
              depth_mult=0.34, in_strides=(8, 16, 32))


def _hgnet_config() -> HGNetV2Config:
    return HGNetV2Config(**TINY_HF, use_learnable_affine_block=True, out_indices=[2, 3, 4])


def reference(name: str):
    """The tiny transformers detector ``name`` (eval, fp32, perturbed)."""
    if name.startswith('dfine'):
        extra = DFINE_WIDE if name == 'dfine_wide' else {}
        model = DFineForObjectDetection(DFineConfig(backbone_config=_hgnet_config(),
                                                    **{**TINY_DFINE, **extra}))
    elif name == 'deimv2':
        model = Deimv2ForObjectDetection(Deimv2Config(backbone_config=_hgnet_config(),
                                                      **TINY_DFINE))
    else:
        model = Deimv2ForObjectDetection(Deimv2Config(
            backbone_config=DINOv3ViTConfig(apply_layernorm=True, **TINY_VIT_HF),
            **TINY_DEIMV2))
    torch.manual_seed(0)
    constants = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(CONSTANTS)}
    perturb_(model)
    model.load_state_dict(constants, strict=False)  # the bins' settings stay the config's
    return model.eval()


def head_config(cfg, style: str) -> dict:
    """Our ``DFineHead`` for a transformers D-FINE / DEIMv2 config."""
    levels = cfg.num_feature_levels
    points = cfg.decoder_n_points
    return dict(
        type='DFineHead', num_classes=cfg.num_labels,
        in_channels=(cfg.decoder_in_channels[-1],) * levels, embed_dims=cfg.d_model,
        num_queries=cfg.num_queries, num_heads=cfg.decoder_attention_heads,
        ffn_dims=cfg.decoder_ffn_dim, num_layers=cfg.decoder_layers,
        num_points=[points] * levels if isinstance(points, int) else list(points), style=style,
        decoder=dict(offset_scale=cfg.decoder_offset_scale, eval_idx=cfg.eval_idx,
                     use_gateway=getattr(cfg, 'use_gateway', True),
                     query_pos_act=cfg.decoder_activation_function,
                     lqe_top_k=cfg.top_prob_values, lqe_hidden_dims=cfg.lqe_hidden_dim,
                     lqe_layers=cfg.lqe_layers, layer_norm_eps=cfg.layer_norm_eps,
                     share_reg_branch=getattr(cfg, 'share_bbox_head', False)),
        reg_max=cfg.max_num_bins, reg_scale=cfg.reg_scale, up=cfg.up,
        learn_initial_query=cfg.learn_initial_query, num_denoising=cfg.num_denoising,
        label_noise_ratio=cfg.label_noise_ratio, box_noise_scale=cfg.box_noise_scale,
        class_loss='vfl' if style == 'dfine' else 'mal', dense_one_to_one=style == 'deimv2',
        batch_norm_eps=cfg.batch_norm_eps)


def detector_config(name: str, cfg) -> dict:
    """Our mmdet detector for the reference ``name`` built from its config."""
    # transformers' HGNetV2 holds frozen BatchNorms: ours keeps its statistics in training too
    hgnet = dict(type='HGNetV2Backbone', arch=TINY, out_indices=(1, 2, 3), use_lab=True,
                 norm_eval=True)
    if name.startswith('dfine'):
        parts = (DFINE_PRE, hgnet, dict(HYBRID, in_channels=(24, 32, 48), fuse_op='cat',
                                        version='dfine', csp_type='csp'), 'dfine')
    elif name == 'deimv2':
        parts = (DFINE_PRE, hgnet, dict(HYBRID, in_channels=(24, 32, 48), fuse_op='sum',
                                        version='dfine', csp_type='csp2'), 'deimv2')
    else:
        parts = (IMAGENET, dict(type='DINOv3STABackbone', arch='S', vit=TINY_VIT,
                                taps=(0, 1, 2), final_norm=True, sta_channels=8,
                                hidden_dim=32),
                 dict(HYBRID, in_channels=(32, 32, 32), fuse_op='sum', version='deim',
                      csp_type='csp2', input_proj=False), 'deimv2')
    pre, backbone, neck, style = parts
    return dict(_scope_='mmdet', type='SingleStageDetector', data_preprocessor=pre,
                backbone=backbone, neck=neck, bbox_head=head_config(cfg, style),
                test_cfg=dict(max_per_img=cfg.num_queries))  # D-FINE's num_top_queries


NAMES = ['dfine', 'dfine_wide', 'deimv2', 'deimv2_dinov3']


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    cache: Dict[str, tuple] = {}

    def build(name: str):
        if name not in cache:
            ref = reference(name)
            folder = tmp_path_factory.mktemp(name)
            ref.save_pretrained(folder)
            ours = MODELS.build(detector_config(name, ref.config))
            from vitdet_plugin.weights import load_checkpoint_file
            sd = load_checkpoint_file(str(folder))
            converted, _ = dfine_to_detector(
                sd, {k: v.shape for k, v in ours.state_dict().items()})
            ours.load_state_dict(converted)
            cache[name] = (ref, ours.eval(), str(folder))
        return cache[name]
    return build


def _images(shape: Tuple[int, int], count: int = 2) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    return list((torch.rand(count, 3, *shape, generator=gen) * 255).round())


def _batch(ours, shape, images, gts=None) -> dict:
    samples = []
    for i, _ in enumerate(images):
        sample = DetDataSample(metainfo=dict(img_shape=shape, ori_shape=shape,
                                             scale_factor=(1.0, 1.0)))
        if gts is not None:
            sample.gt_instances = gts[i]
        samples.append(sample)
    return ours.data_preprocessor(dict(inputs=images, data_samples=samples), gts is not None)


def _their_pixels(name: str, images: List[torch.Tensor]) -> torch.Tensor:
    rgb = torch.stack(images).flip(1)
    if name != 'deimv2_dinov3':
        return rgb / 255
    mean = torch.tensor(IMAGENET['mean'])[:, None, None]
    std = torch.tensor(IMAGENET['std'])[:, None, None]
    return (rgb - mean) / std


def _backbone_maps(name: str, ref, x: torch.Tensor) -> List[torch.Tensor]:
    if name.startswith('dfine'):
        return [f for f, _ in ref.model.backbone(x, torch.ones(x.shape[0], *x.shape[-2:]))]
    if name == 'deimv2':
        return list(ref.model.conv_encoder.model(x).feature_maps)
    return list(ref.model.conv_encoder(x))


@pytest.mark.parametrize('shape', SIZES, ids=['64x64', '64x96'])
@pytest.mark.parametrize('name', NAMES)
def test_detector_matches_transformers(built, name, shape):
    ref, ours, _ = built(name)
    images = _images(shape)
    data = _batch(ours, shape, images)
    x = _their_pixels(name, images)
    assert (data['inputs'] - x).abs().max() <= 1e-5
    encoder: list = []
    hook = ref.model.encoder.register_forward_hook(lambda m, a, out: encoder.append(out))
    with torch.no_grad():
        out = ref(pixel_values=x)
        hook.remove()
        ref.model.decoder.train()  # every layer's predictions
        layered = ref(pixel_values=x)
        ref.model.decoder.eval()
        their_enc = getattr(encoder[0], 'feature_maps', None) or encoder[0].last_hidden_state
        maps = ours.backbone(data['inputs'])
        assert_close_rel(maps, _backbone_maps(name, ref, x))
        feats = ours.neck(maps)
        assert_close_rel(feats, list(their_enc))
        head = ours.bbox_head
        head.decoder.train()  # every layer's predictions
        img_hw = torch.tensor([shape] * len(images))
        decoded = head.decode(feats, img_hw, shape, None)
        head.decoder.eval()
        preds = ours.predict(data['inputs'], data['data_samples'])
    layers = decoded.decoder.logits.shape[0]
    assert layers == ref.config.decoder_layers == layered.intermediate_logits.shape[1] - 1
    errors = {'logits': 0.0, 'boxes': 0.0}
    for i in range(layers):
        errors['logits'] = max(errors['logits'], float(
            (decoded.decoder.logits[i] - layered.intermediate_logits[:, i + 1]).abs().max()))
        errors['boxes'] = max(errors['boxes'], float((
            decoded.decoder.boxes[i] - layered.intermediate_reference_points[:, i + 1]
        ).abs().max()))
    assert errors['logits'] <= LAYER_TOL and errors['boxes'] <= LAYER_TOL, errors
    want = RTDetrImageProcessor().post_process_object_detection(
        out, threshold=0.0, target_sizes=[shape] * len(images))
    side = torch.tensor([shape[1], shape[0]] * 2, dtype=torch.float32)
    for pred, theirs in zip(preds, want):
        got = pred.pred_instances
        assert torch.equal(got.labels, theirs['labels'])
        assert (got.scores - theirs['scores']).abs().max() <= SCORE_TOL
        clipped = torch.minimum(theirs['boxes'].clamp(min=0), side)
        assert ((got.bboxes - clipped).abs() / side).max() <= BOX_SIDE_TOL


def _gts(num_classes: int, shape: Tuple[int, int]) -> List[InstanceData]:
    """Two images' ground truth (3 and 1 objects), xyxy pixels."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for count in (3, 1):
        centre = torch.rand(count, 2, generator=gen) * 0.5 + 0.25
        size = torch.rand(count, 2, generator=gen) * 0.3 + 0.1
        wh = torch.tensor([shape[1], shape[0]], dtype=torch.float32)
        boxes = torch.cat([(centre - size / 2) * wh, (centre + size / 2) * wh], -1)
        out.append(InstanceData(bboxes=boxes,
                                labels=torch.randint(0, num_classes, (count,), generator=gen)))
    return out


def _their_losses(ours, ref, out) -> Dict[str, torch.Tensor]:
    """DFineCriterion on the authors' sets of transformers' training outputs."""
    head = ours.bbox_head
    meta = out.denoising_meta_values
    decoder = DFineDecoderOutput(
        logits=out.intermediate_logits[:, 1:].transpose(0, 1),
        boxes=out.intermediate_reference_points[:, 1:].transpose(0, 1),
        corners=out.intermediate_predicted_corners.transpose(0, 1),
        hidden=out.intermediate_logits[:, 1:].transpose(0, 1),
        initial_boxes=out.initial_reference_points[:, 0],
        pre_boxes=out.intermediate_reference_points[:, 0],
        pre_logits=out.intermediate_logits[:, 0])
    final, aux, dn = dfine_prediction_sets(decoder, out.enc_topk_logits, out.enc_topk_bboxes,
                                           meta['dn_num_split'][0])
    criterion = DFineCriterion(head.num_classes, head.criterion.class_loss,
                               dense_one_to_one=head.criterion.dense_one_to_one)
    return criterion, (final, aux, dn, meta)


@pytest.mark.parametrize('name', ['dfine', 'deimv2'])
def test_training_losses_and_gradients_match_transformers(built, name):
    ref, ours = (copy.deepcopy(m) for m in built(name)[:2])  # training moves BN statistics
    shape = (64, 96)
    images = _images(shape)
    gts = _gts(ref.config.num_labels, shape)
    ref.train()
    ours.train()
    data = _batch(ours, shape, images, gts)
    wh = torch.tensor([shape[1], shape[0]] * 2, dtype=torch.float32)
    labels = [{'class_labels': g.labels,
               'boxes': torch.cat([(g.bboxes[:, :2] + g.bboxes[:, 2:]) / 2,
                                   g.bboxes[:, 2:] - g.bboxes[:, :2]], -1) / wh}
              for g in gts]
    torch.manual_seed(5)
    out = ref(pixel_values=_their_pixels(name, images), labels=labels)
    criterion, (final, aux, dn, meta) = _their_losses(ours, ref, out)
    targets = [(t['boxes'], t['class_labels']) for t in labels]
    want = criterion(final, aux, targets, dn, meta['dn_positive_idx'],
                     meta['dn_num_group'])
    torch.manual_seed(5)
    got = ours.loss(data['inputs'], data['data_samples'])
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=1e-4), (k, got[k], want[k])
    sum(want.values()).backward()
    sum(got.values()).backward()
    # every head parameter's gradient, through the key map
    grads = {k: v.grad for k, v in ref.state_dict(keep_vars=True).items()
             if isinstance(v, torch.nn.Parameter) and v.grad is not None}
    theirs = dfine_head_state_dict(grads)
    mine = {k: p.grad for k, p in ours.bbox_head.named_parameters() if p.grad is not None}
    assert sorted(mine) == sorted(theirs)
    for k, g in mine.items():
        assert torch.allclose(g, theirs[k], atol=1e-5, rtol=1e-3), k


@pytest.mark.parametrize('name', ['dfine', 'deimv2_dinov3'])
def test_detector_init_cfg_loads_the_folder(built, name):
    """``init_cfg=dict(type='Pretrained', checkpoint=FOLDER)`` on the detector loads the whole
    transformers detector (backbone, encoder, head) as the direct conversion does."""
    ref, ours, folder = built(name)
    cfg = detector_config(name, ref.config)
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=folder)
    loaded = MODELS.build(cfg)
    loaded.init_weights()
    want = ours.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_detector_of_another_size_is_refused(built):
    ref, _, folder = built('dfine')
    cfg = detector_config('dfine', ref.config)
    cfg['bbox_head']['num_classes'] = 5
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=folder)
    with pytest.raises(CheckpointError, match=r'the transformers DFine checkpoint does not '
                                              r'match SingleStageDetector: shape mismatch'):
        MODELS.build(cfg).init_weights()


@pytest.mark.parametrize('name', ['dfine', 'deimv2'])
def test_convert_weights_tool_writes_the_detector(built, name, tmp_path, capsys):
    """``tools/convert_weights.py FOLDER OUT.pth``: the detector's tensors as the direct
    conversion gives them (the BatchNorm counters, which transformers does not save, aside)."""
    _, ours, folder = built(name)
    out = str(tmp_path / 'ours.pth')
    assert load_tool('convert_weights.py').main([folder, out]) == 0
    assert 'a D-FINE / DEIMv2 detector config' in capsys.readouterr().out
    saved = torch.load(out, weights_only=True)['state_dict']
    want = ours.state_dict()
    missing = set(want) - set(saved)
    assert missing and all(k.startswith('backbone.') and k.endswith('.num_batches_tracked')
                           for k in missing)
    for k, v in saved.items():
        assert torch.equal(v, want[k]), k


def test_convert_weights_tool_refuses_a_dinov3_detector(built, capsys):
    _, _, folder = built('deimv2_dinov3')
    assert load_tool('convert_weights.py').main([folder, 'unused.pth']) == 1
    assert ("its DINOv3 converts for a given model (LayerScale, k bias): load the folder with "
            "the detector's init_cfg=dict(type='Pretrained', checkpoint=FOLDER)"
            in capsys.readouterr().err)


def test_another_transformers_folder_is_refused_as_a_detector(built, tmp_path):
    """A backbone's folder (transformers HGNetV2) given as the detector's checkpoint."""
    ref, _, _ = built('dfine')
    folder = tmp_path / 'hgnetv2'
    ref.model.backbone.model.save_pretrained(folder)
    cfg = detector_config('dfine', ref.config)
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=str(folder))
    with pytest.raises(CheckpointError, match=r'is a transformers folder but no '
                                              r'DFineForObjectDetection / '
                                              r'Deimv2ForObjectDetection / '
                                              r'RfDetrForObjectDetection / '
                                              r'RfDetrForInstanceSegmentation: only those load'):
        MODELS.build(cfg).init_weights()


def test_a_head_of_other_bins_is_refused(built):
    """D-FINE X's reg_scale 8 in the config of a reg_scale-4 checkpoint: the boxes would be
    decoded on other bins."""
    ref, _, folder = built('dfine')
    cfg = detector_config('dfine', ref.config)
    cfg['bbox_head']['reg_scale'] = 8.0
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=folder)
    with pytest.raises(ValueError, match=r'the checkpoint has reg_scale=\[4\.0\] but the decoder '
                                         r'was built with reg_scale=8\.0; set reg_scale=4'):
        MODELS.build(cfg).init_weights()


def test_a_distilled_dinov3_detector_folder_loads(tmp_path):
    """DEIMv2 S / M's shape in transformers (no registers, its LayerScale of 1, no k bias)
    loads as a whole detector into ours without LayerScale or registers (q / k / v biases, the
    k bias zero) and predicts what transformers post-processes."""
    config = Deimv2Config(backbone_config=DINOv3ViTConfig(
        apply_layernorm=False, **{**TINY_VIT_HF, 'num_register_tokens': 0}), **TINY_DEIMV2)
    torch.manual_seed(0)
    ref = Deimv2ForObjectDetection(config)
    constants = {k: v.clone() for k, v in ref.state_dict().items()
                 if k.endswith(CONSTANTS + ('lambda1',))}
    perturb_(ref)
    ref.load_state_dict(constants, strict=False)
    ref.save_pretrained(tmp_path)
    cfg = detector_config('deimv2_dinov3', ref.config)
    cfg['backbone'].update(final_norm=False, vit=dict(TINY_VIT, layer_scale=None,
                                                      num_reg_tokens=0, qkv_bias='qkv'))
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=str(tmp_path))
    ours = MODELS.build(cfg)
    ours.init_weights()
    shape = (64, 96)
    images = _images(shape)
    data = _batch(ours.eval(), shape, images)
    with torch.no_grad():
        preds = ours.predict(data['inputs'], data['data_samples'])
        out = ref.eval()(pixel_values=_their_pixels('deimv2_dinov3', images))
    want = RTDetrImageProcessor().post_process_object_detection(
        out, threshold=0.0, target_sizes=[shape] * len(images))
    for pred, theirs in zip(preds, want):
        assert torch.equal(pred.pred_instances.labels, theirs['labels'])
        assert (pred.pred_instances.scores - theirs['scores']).abs().max() <= SCORE_TOL
