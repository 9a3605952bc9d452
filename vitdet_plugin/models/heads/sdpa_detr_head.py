"""``SdpaDETRHead``: a DETR-style set-prediction head on multi-scale maps, SDPA attention only.

Pipeline (all in this head, so any backbone/neck feeding NCHW maps can use it through mmdet's
``SingleStageDetector`` or our thin :class:`~vitdet_plugin.models.detectors.SdpaDETR`):

1. :class:`MultiScaleMemory`: chosen levels -> projected, position + level embedded, flattened
   tokens with a padding mask from ``img_shape`` / ``batch_input_shape``.
2. Optional light encoder on chosen memory levels (default: the coarsest).
3. Queries: learned content queries with either learned reference boxes, or (``two_stage``)
   reference boxes from the top-scoring encoder tokens (DINO's mixed query selection), which
   converges much faster.
4. :class:`RefineDecoder`: self-attention, cross-attention to the whole memory (padded tokens
   masked, optional box prior), FFN; boxes refined per layer.
5. :class:`SetCriterion` on every decoder layer (auxiliary losses) and the encoder proposals;
   prediction = top-k over queries x classes, no NMS.
"""
from typing import Dict, Optional, Sequence, Tuple

import torch
from mmdet.models.layers.transformer.utils import inverse_sigmoid
from mmdet.registry import MODELS
from mmengine.structures import InstanceData
from torch import Tensor, nn

from .denoising import DenoisingQueries, split_outputs
from .detr_core import (HeadOutputs, Proposals, SetPredictionHead, gather_rows, reg_mlp,
                         top_proposals)
from .multiscale_memory import FlatMemory, MultiScaleMemory
from .set_criterion import SetCriterion
from .transformer import MemoryEncoder, RefineDecoder, padding_bias

#: Anchor centres of ``two_stage`` are clipped to ``[1 - this, this]`` (normalised): the last,
#: partly valid row / column of a padded map has token centres beyond the image edge, whose
#: ``inverse_sigmoid`` would saturate (logit 11.5) and pin their proposals to the border.
ANCHOR_CENTRE_MAX = 0.99


@MODELS.register_module()
class SdpaDETRHead(SetPredictionHead):
    """DETR-style detection head with dense multi-scale cross-attention through SDPA.

    Args:
        num_classes: foreground classes.
        in_channels: channels of the selected input levels (e.g. ``backbone.out_channels``).
        in_levels: indices of the backbone/neck outputs to use (default: all).
        in_strides: strides of the selected levels (inferred from the map sizes when None).
        num_extra_levels: extra stride-2 levels on top of the last input.
        embed_dims, num_heads, ffn_dims, dropout: transformer sizes.
        num_encoder_layers: encoder layers (0: no encoder).
        encoder_levels: memory levels (indices, extra levels included) the encoder runs on.
        num_decoder_layers: decoder layers (each refines boxes and gets an auxiliary loss).
        num_queries: object queries (detections per image before top-k).
        two_stage: initialise reference boxes from the top encoder tokens; otherwise learned
            reference boxes.
        box_prior: Gaussian box prior in cross-attention (see :class:`BoxAttentionPrior`).
        prior_init_sigmas: initial prior widths ``(smallest, largest)`` across heads.
        anchor_size: normalised side of the level-0 token anchors of ``two_stage``
            (doubling per level).
        enc_one_to_many: with ``two_stage``, train the encoder's token proposals by one-to-many
            matching: every ground truth supervises the ``enc_one_to_many`` memory tokens of
            lowest matching cost (hybrid matching: a dense training signal for the memory, the
            backbone under it and the query selection) instead of the Hungarian matching of the
            selected proposals (DINO's); None keeps DINO's.
        dn_cfg: contrastive denoising queries during training, e.g.
            ``dict(num_dn_queries=100, label_noise_scale=0.5, box_noise_scale=1.0)`` (see
            :class:`DenoisingQueries`); None disables them.
        loss_cls, loss_bbox, loss_iou: loss configs (focal 2.0, L1 5.0, GIoU 2.0 by default).
        train_cfg: ``dict(assigner=...)`` (Hungarian with focal/L1/GIoU costs by default).
        test_cfg: ``dict(max_per_img=100)``.
        init_cfg: mmengine init config.
    """

    criterion: SetCriterion

    def __init__(self,
                 num_classes: int,
                 in_channels: Sequence[int],
                 in_levels: Optional[Sequence[int]] = None,
                 in_strides: Optional[Sequence[int]] = None,
                 num_extra_levels: int = 0,
                 embed_dims: int = 256,
                 num_heads: int = 8,
                 ffn_dims: int = 1024,
                 dropout: float = 0.0,
                 num_encoder_layers: int = 1,
                 encoder_levels: Sequence[int] = (-1,),
                 num_decoder_layers: int = 6,
                 num_queries: int = 300,
                 two_stage: bool = True,
                 box_prior: bool = True,
                 prior_init_sigmas: Tuple[float, float] = (0.5, 4.0),
                 anchor_size: float = 0.05,
                 enc_one_to_many: Optional[int] = None,
                 dn_cfg: Optional[dict] = None,
                 loss_cls: Optional[dict] = None,
                 loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None,
                 train_cfg: Optional[dict] = None,
                 test_cfg: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(num_classes, num_queries, embed_dims, anchor_size, train_cfg, test_cfg,
                         init_cfg)
        if enc_one_to_many is not None and (not two_stage or enc_one_to_many < 1):
            raise ValueError(f'enc_one_to_many={enc_one_to_many} needs two_stage=True and a '
                             'count >= 1 (tokens per ground truth), or None')
        self.enc_one_to_many = enc_one_to_many
        self.two_stage = two_stage
        self.memory = MultiScaleMemory(in_channels, embed_dims, in_levels, num_extra_levels,
                                       in_strides)
        num_levels = self.memory.num_levels
        self.encoder_levels = sorted({self._level_index(i, num_levels)
                                      for i in encoder_levels}) if num_encoder_layers else []
        self.encoder = MemoryEncoder(num_encoder_layers, embed_dims, num_heads, ffn_dims,
                                     dropout)
        self.decoder = RefineDecoder(num_decoder_layers, embed_dims, num_heads, ffn_dims,
                                     dropout, box_prior, prior_init_sigmas)
        self.query_embedding = nn.Embedding(num_queries, embed_dims)
        if two_stage:
            self.enc_output = nn.Linear(embed_dims, embed_dims)
            self.enc_output_norm = nn.LayerNorm(embed_dims)
            self.ref_logits = None
        else:
            self.ref_logits = nn.Parameter(torch.empty(num_queries, 4))
        # one branch per decoder layer, plus one for the encoder proposals
        num_branches = num_decoder_layers + int(two_stage)
        self.cls_branches = nn.ModuleList(
            nn.Linear(embed_dims, num_classes) for _ in range(num_branches))
        self.reg_branches = nn.ModuleList(reg_mlp(embed_dims) for _ in range(num_branches))
        self.dn = None if dn_cfg is None else DenoisingQueries(num_classes, embed_dims,
                                                                **dn_cfg)
        assigner = self.train_cfg.get('assigner')
        self.criterion = SetCriterion(num_classes, assigner, loss_cls, loss_bbox, loss_iou)
        self._init_head_weights()

    @staticmethod
    def _level_index(i: int, num_levels: int) -> int:
        if not -num_levels <= i < num_levels:
            raise IndexError(f'encoder_levels entry {i} is out of range for {num_levels} memory '
                             'levels (inputs + extra levels)')
        return i % num_levels

    def _init_head_weights(self) -> None:
        self.init_branches(self.cls_branches, self.reg_branches)
        nn.init.normal_(self.query_embedding.weight)
        if self.ref_logits is not None:
            # centres spread uniformly over the image, small boxes (DAB-DETR style)
            with torch.no_grad():
                self.ref_logits[:, :2].uniform_(0, 1)
                self.ref_logits[:, 2:].fill_(self.anchor_size * 2)
                self.ref_logits.copy_(inverse_sigmoid(self.ref_logits))

    # ------------------------------------------------------------------ forward
    def _encode(self, fm: FlatMemory) -> Tensor:
        if not self.encoder_levels or not len(self.encoder.layers):
            return fm.memory
        slices = fm.level_slices()
        idx = torch.cat([torch.arange(slices[i].start, slices[i].stop, device=fm.memory.device)
                         for i in self.encoder_levels])
        encoded = self.encoder(fm.memory[:, idx], fm.pos[:, idx],
                               fm.padding_mask[:, idx] if fm.padded else None)
        return fm.memory.index_copy(1, idx, encoded.to(fm.memory.dtype))

    def _initial_queries(self, fm: FlatMemory, memory: Tensor
                         ) -> Tuple[Tensor, Tensor, Optional[Proposals]]:
        """The decoder's content queries ``(B, Q, C)``, reference boxes ``(B, Q, 4)`` and, with
        ``two_stage``, the :class:`Proposals` they come from (every token's too)."""
        b, n, _ = memory.shape
        if not self.two_stage:
            if self.ref_logits is None:  # built in __init__ whenever two_stage is False
                raise RuntimeError('two_stage=False but the head has no ref_logits')
            query = self.query_embedding.weight[None].expand(b, -1, -1)
            return query.to(memory.dtype), self.ref_logits.sigmoid()[None].expand(b, -1, -1), None
        valid = (~fm.padding_mask)[..., None]
        out = self.enc_output_norm(self.enc_output(memory)) * valid
        enc_cls = self.cls_branches[-1](out)                                     # (B, N, K)
        wh = self.anchor_size * torch.pow(2.0, fm.level_ids.float())
        centres = fm.token_xy.clamp(1 - ANCHOR_CENTRE_MAX, ANCHOR_CENTRE_MAX)
        anchors = torch.cat((centres, wh[None, :, None].expand(b, n, 2)), -1)
        enc_box = (self.reg_branches[-1](out).float() + inverse_sigmoid(anchors)).sigmoid()
        score = enc_cls.detach().float().max(-1).values.masked_fill(fm.padding_mask,
                                                                    float('-inf'))
        top = top_proposals(score, self.num_queries)                            # (B, k)
        top_box = gather_rows(enc_box, top)
        props = Proposals(top_box.detach(), gather_rows(enc_cls, top), top_box, top,
                          gather_rows(out, top))
        if self.enc_one_to_many is not None and self.training:  # every token's, one-to-many
            props = props._replace(dense_cls=enc_cls, dense_boxes=enc_box,
                                   dense_unusable=fm.padding_mask)
        query = self.query_embedding.weight[None, :top.shape[1]].expand(b, -1, -1)
        return query.to(memory.dtype), props.ref, props

    def forward(self, feats: Sequence[Tensor], batch_img_metas: Optional[Sequence[dict]] = None,
                batch_gt_instances: Optional[Sequence[InstanceData]] = None) -> HeadOutputs:
        """Predictions for NCHW ``feats`` (images described by mmdet ``batch_img_metas``).

        With ``dn_cfg``, in training mode and given ``batch_gt_instances``, denoising queries
        run alongside the matching queries.
        """
        return self.forward_memory(self.memory(feats, batch_img_metas), batch_img_metas,
                                   batch_gt_instances)

    def forward_images(self, feats: Sequence[Tensor], img_hw: Tensor,
                       batch_shape: Tuple[int, int]) -> HeadOutputs:
        """:meth:`forward` at test for maps covering the padded batch ``batch_shape`` of images
        of ``img_hw`` ``(B, 2)`` (the exported graph's entry: its symbolic sizes)."""
        return self.forward_memory(self.memory.flatten(self.memory.select(feats), batch_shape,
                                                       img_hw.float()))

    def forward_memory(self, fm: FlatMemory, batch_img_metas: Optional[Sequence[dict]] = None,
                       batch_gt_instances: Optional[Sequence[InstanceData]] = None
                       ) -> HeadOutputs:
        """:meth:`forward` from the flattened memory."""
        memory = self._encode(fm)
        query, ref, proposals = self._initial_queries(fm, memory)
        dn = None
        if self.dn is not None and self.training and batch_gt_instances is not None:
            if batch_img_metas is None:
                raise ValueError('denoising queries need batch_img_metas with img_shape')
            dn = self.dn(batch_gt_instances, batch_img_metas, query.shape[1])
        self_bias = None
        if dn is not None:
            query = torch.cat((dn.query.to(query.dtype), query), 1)
            ref = torch.cat((dn.ref_boxes, ref.float()), 1)
            self_bias = dn.self_bias
        memory_key = memory + fm.pos
        memory_bias = padding_bias(fm.padding_mask if fm.padded else None)
        hidden, boxes = self.decoder(query, ref, memory, memory_key, fm.token_xy, memory_bias,
                                     self.reg_branches, self_bias)
        cls = torch.stack([branch(h) for branch, h in zip(self.cls_branches, hidden)])
        boxes = torch.stack(boxes)
        outs = HeadOutputs(cls, boxes) if proposals is None else proposals.outputs(cls, boxes)
        if dn is None:
            return outs
        dn_cls, cls = split_outputs(cls, dn.num_queries)
        dn_boxes, boxes = split_outputs(boxes, dn.num_queries)
        return outs._replace(all_cls_scores=cls, all_bbox_preds=boxes, dn_cls_scores=dn_cls,
                             dn_bbox_preds=dn_boxes, dn_matches=dn.matches)

    # ------------------------------------------------------------------ training
    def loss_by_feat(self, outs: HeadOutputs, batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict]) -> Dict[str, Tensor]:
        """Set losses of every decoder layer (``d{i}.`` prefixes for auxiliary layers), of
        the encoder proposals (``enc_`` prefix) and of the denoising queries (``dn_``)."""
        losses = self.layer_losses(outs.all_cls_scores, outs.all_bbox_preds,
                                   batch_gt_instances, batch_img_metas)
        if outs.dense_cls_scores is not None and self.enc_one_to_many is not None:
            enc = self.one_to_many_losses(outs, batch_gt_instances, batch_img_metas,
                                          self.enc_one_to_many)
            losses.update({'enc_' + k: v for k, v in enc.items()})
        elif outs.enc_cls_scores is not None:
            enc = self.criterion(outs.enc_cls_scores, outs.enc_bbox_preds, batch_gt_instances,
                                 batch_img_metas)
            losses.update({'enc_' + k: v for k, v in enc.items()})
        if outs.dn_cls_scores is not None:
            if outs.dn_bbox_preds is None:
                raise ValueError('HeadOutputs has dn_cls_scores but no dn_bbox_preds')
            losses.update(self.layer_losses(outs.dn_cls_scores, outs.dn_bbox_preds,
                                            batch_gt_instances, batch_img_metas, 'dn_',
                                            matches=outs.dn_matches))
        return losses
