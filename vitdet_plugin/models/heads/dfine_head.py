"""``DFineHead``: the D-FINE / DEIMv2 detection head on a hybrid (or lite) encoder's maps.

Pipeline (transformers' ``DFineModel`` / ``Deimv2Model`` after the encoder):

1. ``input_proj``: per level, Identity when the maps already have ``embed_dims`` channels, else
   a 1x1 conv + BatchNorm (transformers' ``decoder_input_proj``).
2. :func:`~.detr_memory.flatten_levels`: maps -> tokens, their ``(h, w)`` read from the tensor
   shapes. D-FINE uses no padding mask: every token is memory, and the grid anchors and their
   valid mask (anchors inside ``(eps, 1 - eps)``) come from the map shapes alone.
3. :class:`~.dfine_decoder.DFineQuerySelector`: the two-stage top-``num_queries`` tokens.
4. Training: :func:`~.dfine_decoder.contrastive_denoising_group` queries before them.
5. :class:`~.dfine_decoder.DFineDecoder`: every layer's logits and boxes (the ``eval_idx`` layer
   alone at test).

Boxes are normalised cxcywh over the padded batch (the maps), as D-FINE trains them; the test
path (:meth:`DFineHead.forward_images` in eval) re-normalises them by each image's size, the
frame of :class:`~.detr_core.SetPredictionHead`'s batched top-k (D-FINE's post-processing:
sigmoid scores, top ``max_per_img`` over queries x classes, no NMS). Losses:
:class:`~vitdet_plugin.models.losses.DFineCriterion` on the D-FINE authors' prediction sets
(:func:`~vitdet_plugin.models.losses.dfine_prediction_sets`).
"""
from collections import OrderedDict
from typing import ClassVar, cast, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from mmdet.registry import MODELS
from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
from mmengine.model import bias_init_with_prob
from mmengine.structures import InstanceData
from torch import Tensor, nn

from ..losses.dfine_criterion import DFineCriterion, dfine_prediction_sets
from .detr_core import CLS_PRIOR_PROB, HeadOutputs, SetPredictionHead
from .detr_memory import Shape, flatten_levels, image_sizes, size_tensor
from .dfine_decoder import (ANCHOR_GRID_SIZE, DenoisingGroup, DFineDecoder, DFineDecoderOutput,
                            DFineQuerySelector, SelectedQueries, contrastive_denoising_group)

#: Head styles: D-FINE (VFL, LayerNorm decoder) and DEIMv2 (MAL, RMSNorm / SwiGLU decoder).
STYLES = ('dfine', 'deimv2')


class DFineTrainOutputs(NamedTuple):
    """A training forward: :class:`HeadOutputs` of the matching queries, and what the losses
    need beside them: the decoder's output (denoising queries first), the selection and the
    denoising group (None without ground truth)."""
    head: HeadOutputs
    decoder: DFineDecoderOutput
    selected: SelectedQueries
    denoising: Optional[DenoisingGroup]


def _conv_norm(in_channels: int, out_channels: int, eps: float) -> nn.Module:
    """1x1 conv without bias + BatchNorm (``conv`` / ``norm``)."""
    return nn.Sequential(OrderedDict(
        conv=nn.Conv2d(in_channels, out_channels, 1, bias=False),
        norm=nn.BatchNorm2d(out_channels, eps=eps)))


@MODELS.register_module()
class DFineHead(SetPredictionHead):
    """D-FINE (``style='dfine'``) / DEIMv2 (``style='deimv2'``) head.

    Args:
        num_classes: foreground classes (sigmoid logits, no background).
        in_channels: channels of each encoder map (transformers' ``decoder_in_channels``).
        embed_dims: decoder width (``d_model``); maps of other widths get ``input_proj``.
        num_queries: matching queries (detections per image before the top-k).
        num_heads, ffn_dims, num_layers, num_points: decoder sizes (``num_points``: per level).
        style: ``'dfine'`` or ``'deimv2'`` (decoder layer form).
        decoder: more :class:`DFineDecoder` arguments (``eval_idx``, ``use_gateway``,
            ``query_pos_act``, ``mlp_act`` (also the query selection's box MLP),
            ``share_reg_branch``, ``lqe_hidden_dims``, ``sampling``, ...).
        reg_max, reg_scale, up: the edge distributions' bins (decoder and criterion).
        learn_initial_query: start the decoder from learnt query embeddings.
        enc_output: the query selection's Linear + LayerNorm on the memory (D-FINE,
            transformers' DEIMv2 folders); False for the official DEIMv2 checkpoints, which
            score the memory as it is.
        num_denoising, label_noise_ratio, box_noise_scale: contrastive denoising (training).
        class_loss: ``'vfl'`` (D-FINE) or ``'mal'`` (DEIMv2).
        dense_one_to_one: DEIMv2's union of the layers' matchings for the box terms.
        criterion: more :class:`DFineCriterion` arguments (``loss_weights``, ``focal_alpha``,
            ``mal_alpha``, ``match_costs``, ...).
        batch_norm_eps: ``input_proj``'s BatchNorm epsilon.
        train_cfg: unused (the matcher is the criterion's); kept for mmdet's interface.
        test_cfg: ``dict(max_per_img=300)`` (D-FINE's ``num_top_queries``), ``score_thr``.
        init_cfg: mmengine init config.
    """

    default_max_per_img: ClassVar[int] = 300

    def __init__(self, num_classes: int, in_channels: Sequence[int] = (256, 256, 256),
                 embed_dims: int = 256, num_queries: int = 300, num_heads: int = 8,
                 ffn_dims: int = 1024, num_layers: int = 6,
                 num_points: Union[int, Sequence[int]] = (4, 4, 4), style: str = 'dfine',
                 decoder: Optional[dict] = None, reg_max: int = 32, reg_scale: float = 4.0,
                 up: float = 0.5, learn_initial_query: bool = False, enc_output: bool = True,
                 num_denoising: int = 100,
                 label_noise_ratio: float = 0.5, box_noise_scale: float = 1.0,
                 class_loss: str = 'vfl', dense_one_to_one: bool = False,
                 criterion: Optional[dict] = None, batch_norm_eps: float = 1e-5,
                 train_cfg: Optional[dict] = None, test_cfg: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(num_classes, num_queries, embed_dims, ANCHOR_GRID_SIZE, train_cfg,
                         test_cfg, init_cfg)
        if style not in STYLES:
            raise ValueError(f'style={style!r} is not one of {STYLES}; use dfine for D-FINE and '
                             'deimv2 for DEIMv2')
        levels = len(num_points) if not isinstance(num_points, int) else len(in_channels)
        if levels != len(in_channels):
            raise ValueError(f'num_points={list(num_points)} gives {levels} levels but '  # type: ignore[arg-type]
                             f'in_channels={list(in_channels)} has {len(in_channels)}: give '
                             'one point count per encoder map')
        self.in_channels = tuple(in_channels)
        #: the distribution bins' ``(up, reg_scale)`` (a checkpoint's must be the same)
        self.bins = (up, reg_scale)
        self.num_denoising = num_denoising
        self.label_noise_ratio = label_noise_ratio
        self.box_noise_scale = box_noise_scale
        self.input_proj = nn.ModuleList(
            nn.Identity() if c == embed_dims else _conv_norm(c, embed_dims, batch_norm_eps)
            for c in in_channels)
        self.selector = DFineQuerySelector(
            num_classes, num_queries, embed_dims, learn_initial_query, enc_output=enc_output,
            mlp_act=(decoder or {}).get('mlp_act', 'relu'))
        self.decoder = DFineDecoder(num_classes, embed_dims, num_heads, ffn_dims, num_layers,
                                    num_points, reg_max=reg_max, reg_scale=reg_scale, up=up,
                                    style=style, **(decoder or {}))
        self.dn_label_embed = (nn.Embedding(num_classes + 1, embed_dims,
                                            padding_idx=num_classes)
                               if num_denoising > 0 else None)
        self.criterion = DFineCriterion(num_classes, class_loss, reg_max=reg_max,  # type: ignore[assignment]
                                        reg_scale=reg_scale, up=up,
                                        dense_one_to_one=dense_one_to_one, **(criterion or {}))
        self._init_head_weights()

    def _init_head_weights(self) -> None:
        """D-FINE's init: class biases at the focal prior, the last layer of every box and
        distribution MLP and of the quality estimators zero (the first boxes are the
        anchors / references), Xavier query-position and selection projections."""
        bias = bias_init_with_prob(CLS_PRIOR_PROB)
        for cls in [self.selector.enc_score_head, *self.decoder.cls_branches]:
            nn.init.constant_(cls.bias, bias)
        mlps = [self.selector.enc_bbox_head, self.decoder.pre_bbox_head,
                *self.decoder.reg_branches, *(q.reg_conf for q in self.decoder.lqe_layers)]
        for mlp in mlps:
            last = mlp.layers[-1]
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        if isinstance(self.selector.enc_output, nn.Sequential):
            nn.init.xavier_uniform_(cast(nn.Linear, self.selector.enc_output[0]).weight)
        for layer in self.decoder.query_pos_head.layers:
            nn.init.xavier_uniform_(cast(nn.Linear, layer).weight)

    # ------------------------------------------------------------------ forward
    def forward(self, feats: Sequence[Tensor], batch_img_metas: Optional[Sequence[dict]] = None,
                batch_gt_instances: Optional[Sequence[InstanceData]] = None
                ) -> Union[HeadOutputs, DFineTrainOutputs]:
        """Predictions for the encoder's maps (images described by mmdet ``batch_img_metas``;
        without them the batch is unpadded). In training, the ground truth adds denoising
        queries and the result is a :class:`DFineTrainOutputs`; in eval,
        :meth:`forward_images`."""
        img_hw, batch_shape = image_sizes(batch_img_metas, feats[0].shape[0], feats[0].device,
                                          (int(feats[0].shape[-2]), int(feats[0].shape[-1])))
        if not self.training:
            return self.forward_images(feats, img_hw, batch_shape)
        denoising = None
        if batch_gt_instances is not None and self.dn_label_embed is not None:
            targets = self.targets(batch_gt_instances, batch_shape)
            denoising = contrastive_denoising_group(
                [lab for _, lab in targets], [box for box, _ in targets], self.num_classes,
                self.num_queries, self.dn_label_embed, self.num_denoising,
                self.label_noise_ratio, self.box_noise_scale)
        return self.decode(feats, img_hw, batch_shape, denoising)

    def forward_images(self, feats: Sequence[Tensor], img_hw: Tensor,
                       batch_shape: Shape) -> HeadOutputs:
        """The test path: the ``eval_idx`` layer's ``(1, B, Q, K)`` logits and ``(1, B, Q, 4)``
        cxcywh boxes normalised by each image's ``img_hw`` ``(B, 2)`` (maps covering the padded
        ``batch_shape``), and the selection's; the exported graph's entry."""
        out = self.decode(feats, img_hw, batch_shape, None)
        assert out.head.enc_bbox_preds is not None  # the selection's boxes are always there
        scale = (size_tensor(batch_shape, img_hw.device) / img_hw).flip(-1).to(
            out.head.all_bbox_preds.dtype).repeat(1, 2)[:, None]             # (B, 1, 4) wh wh
        return out.head._replace(all_bbox_preds=out.head.all_bbox_preds * scale,
                                 enc_bbox_preds=out.head.enc_bbox_preds * scale)

    def project(self, feats: Sequence[Tensor]) -> List[Tensor]:
        """``input_proj`` of every map (checked against ``in_channels``)."""
        if len(feats) != len(self.in_channels) or any(
                x.shape[1] != c for x, c in zip(feats, self.in_channels)):
            raise ValueError(f'{type(self).__name__} expects maps of in_channels='
                             f'{list(self.in_channels)} channels, got '
                             f'{[tuple(x.shape) for x in feats]}')
        return [proj(x) for proj, x in zip(self.input_proj, feats)]

    def decode(self, feats: Sequence[Tensor], img_hw: Tensor, batch_shape: Shape,
               denoising: Optional[DenoisingGroup]) -> DFineTrainOutputs:
        """Selection and decoder on the maps (padded-batch frame), denoising queries first.
        Every token is memory (D-FINE has no padding mask)."""
        memory = flatten_levels(self.project(feats), img_hw, batch_shape)
        tokens, shapes = memory.tokens, memory.shapes                        # (B, N, C)
        selected = self.selector(tokens, shapes)
        query, ref = selected.query, selected.ref_logits                     # (B, Q, C), (B, Q, 4)
        mask = None
        if denoising is not None:
            query = torch.cat([denoising.query, query], 1)                    # (B, D + Q, C)
            ref = torch.cat([denoising.ref_logits, ref], 1)
            mask = denoising.attn_mask
        decoded = self.decoder(query, ref, tokens, shapes, mask)
        split = 0 if denoising is None else denoising.num_denoising
        head = HeadOutputs(decoded.logits[:, :, split:], decoded.boxes[:, :, split:],
                           selected.topk_logits, selected.topk_boxes,
                           dn_cls_scores=decoded.logits[:, :, :split] if split else None,
                           dn_bbox_preds=decoded.boxes[:, :, :split] if split else None)
        return DFineTrainOutputs(head, decoded, selected, denoising)

    # ------------------------------------------------------------------ training
    @staticmethod
    def targets(batch_gt_instances: Sequence[InstanceData], batch_shape: Shape
                ) -> List[Tuple[Tensor, Tensor]]:
        """Per image: ground-truth cxcywh boxes normalised by the padded batch (the maps'
        frame) and labels."""
        out = []
        for gt in batch_gt_instances:
            boxes = gt.bboxes
            size = boxes.new_tensor([batch_shape[1], batch_shape[0]]).repeat(2)  # (4,) whwh
            out.append((bbox_xyxy_to_cxcywh(boxes / size), gt.labels))
        return out

    def loss_by_feat(self, outs: DFineTrainOutputs,  # type: ignore[override]
                     batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict]) -> Dict[str, Tensor]:
        """:class:`DFineCriterion` on the authors' prediction sets: the last layer, the
        earlier layers, the pre-head and the encoder top-k; the denoising sets with their
        known positives."""
        if not isinstance(outs, DFineTrainOutputs):
            raise ValueError('DFineHead.loss_by_feat needs the outputs of a training forward '
                             '(head.train()); got the test path\'s HeadOutputs')
        _, batch_shape = image_sizes(batch_img_metas, len(batch_img_metas),
                                     outs.head.all_cls_scores.device)
        dn = outs.denoising
        final, aux, dn_sets = dfine_prediction_sets(
            outs.decoder, outs.selected.topk_logits, outs.selected.topk_boxes,
            0 if dn is None else dn.num_denoising)
        return self.criterion(final, aux, self.targets(batch_gt_instances, batch_shape),
                              dn_sets, None if dn is None else dn.positive_idx,
                              1 if dn is None else dn.num_groups)
