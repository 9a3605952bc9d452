"""The ``rfdetr`` package's LW-DETR (transformer + heads) beside our ``LWDETRHead`` with the same
weights, for the parity tests (``test_lwdetr_*``).

rfdetr's ``LWDETR`` is built with its own ``Transformer`` and a stand-in backbone that returns
given projector maps (with their padding masks), so both sides start from the same memory;
every rfdetr parameter is random (seeded) and loaded into ours through our key map.
"""
from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple

import numpy as np
import torch
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
from mmdet.structures.mask import BitmapMasks
from mmengine.registry import init_default_scope
from mmengine.structures import InstanceData
from rfdetr.models.lwdetr import LWDETR
from rfdetr.models.transformer import Transformer
from rfdetr.utilities.tensors import NestedTensor
from torch import Tensor, nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.heads.lwdetr_head import LWDETRHead
from vitdet_plugin.weights.lwdetr_keys import rfdetr_head_state_dict

#: Shrunk sizes (RF-DETR: 256 wide, 300 queries, 13 groups, 8 / 16 heads, 2 points, FFN 2048).
WIDTH, CLASSES, QUERIES, GROUPS = 32, 5, 12, 3
SELF_HEADS, CROSS_HEADS, POINTS, FFN = 2, 4, 2, 64
#: Decoder layers of RF-DETR's N and S (M / L: 4).
LAYERS = {'N': 2, 'S': 3}
#: Stride of the projector's P4 map in input pixels (the ViT patch).
STRIDE = 16


class StubBackbone(nn.Module):
    """rfdetr's backbone ``Joiner`` interface: returns the maps set in :attr:`feats` with their
    padding masks (``NestedTensor``), zero position embeddings (the decoder does not use
    them) and no second projector."""

    def __init__(self) -> None:
        super().__init__()
        self.feats: List[Tensor] = []
        self.masks: List[Tensor] = []

    def forward(self, samples: NestedTensor):
        feats = [NestedTensor(f, m) for f, m in zip(self.feats, self.masks)]
        return feats, [torch.zeros_like(f) for f in self.feats], None


class Pair(NamedTuple):
    ref: LWDETR
    stub: StubBackbone
    ours: LWDETRHead


def _randomize(module: nn.Module, seed: int) -> None:
    """Every parameter random (seeded): matrices ~ N(0, 1 / fan_in) (activations keep their
    scale at any width), norm weights ~ 1 + 0.1 N, biases ~ 0.1 N, the learned reference
    deltas ~ 0.2 N."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if 'refpoint_embed' in name:
                p.copy_(0.2 * noise)
            elif p.dim() > 1:
                p.copy_(noise / p.shape[-1] ** 0.5)
            elif 'norm' in name and name.endswith('weight'):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def build_pair(size: str, num_levels: int = 1, seed: int = 0) -> Pair:
    """rfdetr's LWDETR of RF-DETR ``size``'s decoder depth (shrunk widths) and our head with
    its weights."""
    transformer = Transformer(
        d_model=WIDTH, sa_nhead=SELF_HEADS, ca_nhead=CROSS_HEADS, num_queries=QUERIES,
        num_decoder_layers=LAYERS[size], dim_feedforward=FFN, dropout=0.0,
        return_intermediate_dec=True, group_detr=GROUPS, two_stage=True,
        num_feature_levels=num_levels, dec_n_points=POINTS, lite_refpoint_refine=True,
        decoder_norm_type='LN', bbox_reparam=True)
    stub = StubBackbone()
    ref = LWDETR(stub, transformer, None, num_classes=CLASSES, num_queries=QUERIES,
                 aux_loss=True, group_detr=GROUPS, two_stage=True, lite_refpoint_refine=True,
                 bbox_reparam=True)
    _randomize(ref, seed)
    ours = MODELS.build(dict(
        type='LWDETRHead', num_classes=CLASSES, embed_dims=WIDTH, num_levels=num_levels,
        num_queries=QUERIES, num_groups=GROUPS, num_decoder_layers=LAYERS[size],
        self_heads=SELF_HEADS, cross_heads=CROSS_HEADS, num_points=POINTS, ffn_dims=FFN))
    ours.load_state_dict(rfdetr_head_state_dict(ref.state_dict()), strict=True)
    return Pair(ref, stub, ours)


def inputs(shapes: Sequence[Tuple[int, int]], img_shapes: Sequence[Tuple[int, int]],
           seed: int = 1) -> Tuple[List[Tensor], List[dict], List[Tensor]]:
    """Projector maps of sizes ``shapes`` (level 0 at :data:`STRIDE`, each next level half),
    mmdet metas of images ``img_shapes`` padded to level 0's frame, and rfdetr's padding masks
    ``(B, h, w)`` (True outside the image: the nearest-resized pixel mask)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(img_shapes)
    feats = [torch.randn(b, WIDTH, h, w, generator=gen) for h, w in shapes]
    batch_shape = (shapes[0][0] * STRIDE, shapes[0][1] * STRIDE)
    metas = [dict(img_shape=s, batch_input_shape=batch_shape, scale_factor=(1.0, 1.0))
             for s in img_shapes]
    masks = []
    for level, (h, w) in enumerate(shapes):
        stride = STRIDE * 2 ** level
        pixel_rows = torch.arange(h)[None, :, None] * stride
        pixel_cols = torch.arange(w)[None, None, :] * stride
        img = torch.tensor(img_shapes)
        masks.append((pixel_rows >= img[:, 0, None, None]) | (pixel_cols >= img[:, 1, None, None]))
    return feats, metas, masks


def run_reference(pair: Pair, feats: List[Tensor], masks: List[Tensor]) -> Dict:
    """rfdetr's LWDETR forward on the given maps (its output dict)."""
    pair.stub.feats, pair.stub.masks = feats, masks
    return pair.ref(torch.zeros(feats[0].shape[0], 3, 8, 8))


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def abs_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


def our_loss_names(losses: Mapping[str, Tensor], weights: Mapping[str, float],
                   our_terms: Mapping[str, str]) -> Dict[str, Tensor]:
    """rfdetr's criterion output weighted (``weights``) under our names: ``our_terms`` maps
    its terms, its ``_<i>`` (earlier layers) and ``_enc`` suffixes become ``d{i}.`` and
    ``enc_`` prefixes."""
    named = {}
    for key, value in losses.items():
        for term, ours in our_terms.items():
            if key == term:
                named[ours] = value * weights[term]
            elif key == term + '_enc':
                named['enc_' + ours] = value * weights[term]
            elif key.startswith(term + '_') and key[len(term) + 1:].isdigit():
                named[f'd{key[len(term) + 1:]}.' + ours] = value * weights[term]
    return named


def tiny_detector(bbox_head: dict) -> nn.Module:
    """mmdet's ``SingleStageDetector``: a tiny ViT's two taps, ``RFDETRProjector`` (P4 at
    :data:`WIDTH`) and ``bbox_head``; ``max_per_img=7``."""
    init_default_scope('mmdet')
    return MODELS.build(dict(
        type='SingleStageDetector',
        data_preprocessor=dict(type='DetDataPreprocessor', pad_size_divisor=16),
        backbone=dict(type='ViTBackbone', arch=dict(embed_dims=32, depth=2, num_heads=2),
                      global_attn_indexes=(1,), window_size=4, img_size=96,
                      out_indices=(0, 1)),
        neck=dict(type='RFDETRProjector', in_channels=[32, 32], out_channels=WIDTH,
                  num_blocks=1),
        bbox_head=bbox_head,
        test_cfg=dict(max_per_img=7)))


def tiny_batch(detector: nn.Module, with_masks: bool = False) -> dict:
    """Two images (96x80 and 64x96, so padded to one batch; originals twice as large) with one
    box each (and its mask, ``BitmapMasks`` in the image frame), through the detector's data
    preprocessor (training mode)."""
    samples = []
    for i, (h, w) in enumerate([(96, 80), (64, 96)]):
        ds = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(2 * h, 2 * w),
                                         scale_factor=(0.5, 0.5)))
        ds.gt_instances = InstanceData(bboxes=torch.tensor([[4.0, 6.0, 40.0, 30.0 + i]]),
                                       labels=torch.tensor([i]))
        if with_masks:
            mask = np.zeros((1, h, w), dtype=np.uint8)
            mask[0, 6:30 + i, 4:40] = 1
            ds.gt_instances.masks = BitmapMasks(mask, h, w)
        samples.append(ds)
    images = [torch.rand(3, *s.img_shape) * 255 for s in samples]
    return detector.data_preprocessor(dict(inputs=images, data_samples=samples), True)


def random_targets(seed: int, counts: Sequence[int], img: Tuple[int, int],
                   with_masks: bool = False) -> Tuple[List[dict], List[InstanceData]]:
    """Random normalised cxcywh boxes and labels (and masks: each box's ellipse) of images
    ``img``: rfdetr's targets and our ``InstanceData`` (xyxy pixels, ``BitmapMasks``)."""
    gen = torch.Generator().manual_seed(seed)
    ys = torch.arange(img[0])[:, None] + 0.5
    xs = torch.arange(img[1])[None] + 0.5
    scale = torch.tensor([img[1], img[0], img[1], img[0]], dtype=torch.float32)
    ref, ours = [], []
    for n in counts:
        centres = 0.2 + 0.6 * torch.rand(n, 2, generator=gen)
        sides = 0.1 + 0.3 * torch.rand(n, 2, generator=gen)
        boxes = torch.cat((centres, sides), -1)
        labels = torch.randint(0, CLASSES, (n,), generator=gen)
        ref.append(dict(labels=labels, boxes=boxes))
        ours.append(InstanceData(bboxes=bbox_cxcywh_to_xyxy(boxes) * scale, labels=labels))
        if with_masks:
            cx, cy = boxes[:, 0, None, None] * img[1], boxes[:, 1, None, None] * img[0]
            rx, ry = boxes[:, 2, None, None] * img[1] / 2, boxes[:, 3, None, None] * img[0] / 2
            masks = ((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1          # (n, H, W)
            ref[-1]['masks'] = masks
            ours[-1].masks = BitmapMasks(masks.numpy(), *img)
    return ref, ours


def loss_and_predict(detector: nn.Module, data: dict) -> Tuple[Dict[str, Tensor], list]:
    """One loss step of ``detector`` on ``data`` (every term finite; their sum backpropagated,
    reaching the backbone's patch embedding), then ``predict`` in eval mode."""
    detector.train()
    losses = detector.loss(data['inputs'], data['data_samples'])
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    assert detector.backbone.patch_embed.proj.weight.grad.abs().sum() > 0
    detector.eval()
    with torch.no_grad():
        return losses, detector.predict(data['inputs'], data['data_samples'])
