"""``LWDETRSegHead``: RF-DETR-Seg, :class:`LWDETRHead` with RF-DETR's mask branch.

The mask branch (RF-DETR's ``SegmentationHead``) reads the projector's first map (RF-DETR-Seg:
P4, at the ViT's patch stride) and the decoder's queries:

1. the map is resized (bilinear) to a quarter of the padded batch (``mask_downsample_ratio``);
2. one :class:`DepthwiseBlock` per decoder layer refines it in turn; after each, a 1x1 conv
   gives that layer's pixel embeddings (the proposals use the map before the first block);
3. every layer's queries (and the proposals' features) go through one residual MLP and a
   Linear (shared by all layers);
4. a mask's logits are ``pixel . query + bias`` (one learned scalar).

Training matches and weighs masks by points (:class:`MaskGroupSetCriterion`, every decoder
layer and the proposals); prediction keeps the top-k detections of :class:`LWDETRHead` and
resizes their masks (bilinear, > 0) to the image, as RF-DETR's ``PostProcess``.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.structures import InstanceData
from torch import Tensor, nn

from ..layers.mlp import Mlp
from .detr_core import HeadOutputs, instances
from .detr_memory import Shape, image_sizes
from .lwdetr_head import LWDETRHead
from .lwdetr_seg_loss import POINT_SAMPLE_RATIO, LayerMasks, MaskGroupSetCriterion

#: Mask resolution: the padded batch divided by this (RF-DETR's ``mask_downsample_ratio``).
MASK_DOWNSAMPLE_RATIO = 4
#: LayerNorm epsilon of the depthwise blocks (ConvNeXt's).
BLOCK_NORM_EPS = 1e-6
#: Hidden width of the query MLP, times the channels.
QUERY_MLP_RATIO = 4
#: A pixel's centre, in pixels from its top-left corner (``align_corners=False``).
PIXEL_CENTRE = 0.5


class DepthwiseBlock(nn.Module):
    """A ConvNeXt block without its MLP: depthwise 3x3 conv, channel LayerNorm, Linear, GELU,
    residual (RF-DETR's ``DepthwiseConvBlock``)."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dims, dims, kernel_size=3, padding=1, groups=dims)
        self.norm = nn.LayerNorm(dims, eps=BLOCK_NORM_EPS)
        self.pwconv = nn.Linear(dims, dims)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)                                  # (B, H, W, C)
        y = self.act(self.pwconv(self.norm(y)))
        return x + y.permute(0, 3, 1, 2)                                        # (B, C, H, W)


class ResidualMlp(nn.Module):
    """``x + MLP(LayerNorm(x))`` (GELU, :data:`QUERY_MLP_RATIO` x wide; RF-DETR's
    ``MLPBlock``)."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.mlp = Mlp(dims, QUERY_MLP_RATIO * dims)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class MaskEmbeddings(NamedTuple):
    """Every decoder layer's mask embeddings and the proposals'."""
    layers: Tuple[LayerMasks, ...]
    enc: LayerMasks

    def logits(self, i: int, queries: Optional[Tensor] = None) -> Tensor:
        """Layer ``i``'s mask logits (:meth:`LayerMasks.logits`)."""
        return self.layers[i].logits(queries)


class MaskBranch(nn.Module):
    """RF-DETR's ``SegmentationHead`` (module docstring, steps 1-4).

    Args:
        embed_dims: channels of the map and the queries.
        num_layers: decoder layers (one block each).
        downsample_ratio: mask resolution = padded batch / this.
    """

    def __init__(self, embed_dims: int, num_layers: int,
                 downsample_ratio: int = MASK_DOWNSAMPLE_RATIO) -> None:
        super().__init__()
        self.downsample_ratio = downsample_ratio
        self.blocks = nn.ModuleList(DepthwiseBlock(embed_dims) for _ in range(num_layers))
        self.pixel_proj = nn.Conv2d(embed_dims, embed_dims, kernel_size=1)
        self.query_mlp = ResidualMlp(embed_dims)
        self.query_proj = nn.Linear(embed_dims, embed_dims)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, feat: Tensor, hidden: Tensor, enc_hidden: Tensor,
                batch_shape: Shape) -> MaskEmbeddings:
        """``feat (B, C, h, w)`` covering the padded batch ``batch_shape``, every layer's
        queries ``hidden (L, B, G*Q, C)`` and the proposals' ``enc_hidden (B, G*Q, C)``."""
        size = (batch_shape[0] // self.downsample_ratio, batch_shape[1] // self.downsample_ratio)
        x = F.interpolate(feat, size=size, mode='bilinear', align_corners=False)  # (B,C,Hm,Wm)
        enc = LayerMasks(self.pixel_proj(x), self.query_proj(self.query_mlp(enc_hidden)),
                         self.bias)
        queries = self.query_proj(self.query_mlp(hidden))                      # (L, B, G*Q, C)
        layers = []
        for block, layer_queries in zip(self.blocks, queries):
            x = block(x)
            layers.append(LayerMasks(self.pixel_proj(x), layer_queries, self.bias))
        return MaskEmbeddings(tuple(layers), enc)


class SegHeadOutputs(NamedTuple):
    """:class:`LWDETRHead`'s outputs and the mask embeddings."""
    det: HeadOutputs
    masks: MaskEmbeddings


def masks_to_image(logits: Tensor, img_meta: dict, rescale: bool) -> Tensor:
    """``(K, Hm, Wm)`` mask logits over the padded batch -> ``(K, H, W)`` bool masks of the
    image (``img_shape``, or ``ori_shape`` when ``rescale``): one bilinear resize of the
    image's part (RF-DETR's, which resizes the whole unpadded batch), then ``> 0``. The resize
    is ``grid_sample``'s (``align_corners=False``, border) as two matrix products with each
    axis' weights (:func:`border_weights`): the same taps, run by an exported graph as MatMul,
    far faster than onnxruntime's GridSample (docs/rfdetr.md, latency)."""
    batch_h, batch_w = img_meta['batch_input_shape']
    img_h, img_w = img_meta['img_shape'][:2]
    out_h, out_w = (img_meta['ori_shape'] if rescale else img_meta['img_shape'])[:2]
    rows = border_weights(out_h, img_h / batch_h, logits.shape[-2], logits.device)  # (H, Hm)
    cols = border_weights(out_w, img_w / batch_w, logits.shape[-1], logits.device)  # (W, Wm)
    return rows @ logits.float() @ cols.T > 0                                       # (K, H, W)


def border_weights(length: Any, part: Any, cells: Any, device: torch.device) -> Tensor:
    """``(length, cells)``: along one axis, the bilinear weights of the first ``part`` (a
    fraction) of ``cells`` cells at ``length`` output pixel centres: the centre of pixel ``i``
    at ``pos = (i + 0.5) * part * cells / length - 0.5`` in cell units, clamped to the cells
    (``grid_sample``'s border), weight ``max(0, 1 - |pos - j|)`` for cell ``j``."""
    centres = torch.arange(length, device=device, dtype=torch.float32) + PIXEL_CENTRE
    pos = (centres * (part * cells / length) - PIXEL_CENTRE).clamp(0, cells - 1)  # (length,)
    cell = torch.arange(cells, device=device, dtype=torch.float32)               # (cells,)
    return (1 - (pos[:, None] - cell).abs()).clamp(min=0)                        # (length, cells)


@MODELS.register_module()
class LWDETRSegHead(LWDETRHead):
    """RF-DETR-Seg head: :class:`LWDETRHead` with :class:`MaskBranch` on its first map.

    Args:
        num_classes, **kwargs: :class:`LWDETRHead`'s (RF-DETR-Seg N / S: 100 queries,
            4 decoder layers; the default ``train_cfg`` assigner adds RF-DETR's mask costs).
        mask_downsample_ratio: mask resolution = padded batch / this (RF-DETR: 4).
        loss_mask, loss_dice: point mask losses (sigmoid BCE 5, Dice 5).
        mask_point_sample_ratio: mask pixels per sampled point (RF-DETR: 16).
    """

    criterion: MaskGroupSetCriterion

    def __init__(self, num_classes: int, mask_downsample_ratio: int = MASK_DOWNSAMPLE_RATIO,
                 loss_mask: Optional[dict] = None, loss_dice: Optional[dict] = None,
                 mask_point_sample_ratio: int = POINT_SAMPLE_RATIO, **kwargs: Any) -> None:
        if kwargs.get('dense_one_to_many') is not None:
            raise ValueError('LWDETRSegHead does not take dense_one_to_many: its matching weighs '
                             'masks, which only the top-k proposals have; remove it (or train '
                             'boxes with LWDETRHead)')
        super().__init__(num_classes, **kwargs)
        self.mask_branch = MaskBranch(self.embed_dims, len(self.decoder.layers),
                                      mask_downsample_ratio)
        self.criterion = MaskGroupSetCriterion(
            num_classes, self.train_cfg.get('assigner'), kwargs.get('loss_cls'),
            kwargs.get('loss_bbox'), kwargs.get('loss_iou'), loss_mask, loss_dice,
            mask_point_sample_ratio)

    def forward(self, feats: Sequence[Tensor],  # type: ignore[override]
                batch_img_metas: Optional[Sequence[dict]] = None,
                batch_gt_instances: Optional[Sequence[InstanceData]] = None) -> SegHeadOutputs:
        """:class:`LWDETRHead`'s predictions and the mask embeddings (the metas give the
        padded batch size, which sets the mask resolution)."""
        if not batch_img_metas:
            raise ValueError('LWDETRSegHead needs the image metas (batch_input_shape sets the '
                             'mask resolution); call it through loss / predict')
        return super().forward(feats, batch_img_metas)  # type: ignore[return-value]

    def forward_images(self, feats: Sequence[Tensor], img_hw: Tensor,  # type: ignore[override]
                       batch_shape: Shape) -> SegHeadOutputs:
        """:meth:`LWDETRHead.forward_images` and the mask embeddings."""
        decoded = self.decode(feats, img_hw, batch_shape)
        masks = self.mask_branch(feats[0], decoded.hidden, decoded.proposals.hidden, batch_shape)
        return SegHeadOutputs(self.outputs(decoded), masks)

    def loss_by_feat(self, outs: SegHeadOutputs,  # type: ignore[override]
                     batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict]) -> Dict[str, Tensor]:
        """:class:`LWDETRHead`'s losses with ``loss_mask`` / ``loss_dice`` on every decoder
        layer and the proposals, matches weighing the masks too."""
        layers: List[Dict[str, Any]] = [dict(masks=m) for m in outs.masks.layers]
        return super().loss_by_feat(outs.det, batch_gt_instances, batch_img_metas, layers,
                                    dict(masks=outs.masks.enc))

    def predict_by_feat(self, outs: SegHeadOutputs,  # type: ignore[override]
                        batch_img_metas: Sequence[dict],
                        rescale: bool = True) -> List[InstanceData]:
        """:class:`LWDETRHead`'s detections with their ``masks`` (bool, image size)."""
        img_hw, _ = image_sizes(batch_img_metas, len(batch_img_metas),
                                outs.det.all_cls_scores.device)
        dets = self.detections(outs.det, img_hw)
        logits = outs.masks.logits(-1, dets.queries)                           # (B, k, Hm, Wm)
        results = instances(dets, batch_img_metas, rescale,
                            float(self.test_cfg.get('score_thr', 0.0)))
        for i, (found, meta) in enumerate(zip(results, batch_img_metas)):
            # the scores above score_thr are the first of the descending top-k
            found.masks = masks_to_image(logits[i, :len(found)], meta, rescale)
        return results
