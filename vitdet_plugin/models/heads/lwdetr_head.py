"""``LWDETRHead``: the LW-DETR / RF-DETR detection head on a projector's maps.

Pipeline (RF-DETR's ``two_stage``, ``bbox_reparam``, ``lite_refpoint_refine``):

1. :func:`~.detr_memory.flatten_levels`: the projector's NCHW maps -> tokens, padding mask,
   valid cells (no encoder: the ViT and the projector are the encoder).
2. Two-stage proposals, per query group: the memory (zeroed where unusable) -> Linear +
   LayerNorm -> class and box branches; the top ``P = min(num_queries, tokens)`` tokens by
   their best class logit give proposals, boxes reparameterised on each token's anchor (cell
   centre, side ``anchor_size * 2**level``).
3. Queries: learned content + learned box deltas reparameterised on the (detached) proposals.
   Group DETR: ``num_groups`` query sets (their own proposals and embeddings) in training, the
   first one at test. With fewer tokens than queries (RF-DETR N's smallest training scales),
   the ``G*P`` proposals take the first queries and the rest keep their learned reference
   boxes as they are: RF-DETR's rule (its ``Transformer.forward``).
4. :class:`LWDETRDecoder`; every layer's boxes are predicted relative to the initial reference
   boxes by one shared class / box branch.
5. :class:`GroupSetCriterion` on every layer and on the proposals; prediction = top-k over
   queries x classes, no NMS (:class:`SetPredictionHead`'s, as :class:`SdpaDETRHead`).

Not RF-DETR's, off by default: ``dense_one_to_many=k`` adds a loss on the proposal of every
usable memory token (not only the top ``P``), each ground truth matched to its ``k`` cheapest
tokens per group. Training from random init, the two-stage loss alone reaches ``G`` tokens
per object, too few for the backbone to learn where objects are (the demo, docs/rfdetr.md).
"""
from typing import Any, ClassVar, Dict, NamedTuple, Optional, Sequence, cast

import torch
from mmdet.registry import MODELS
from mmengine.structures import InstanceData
from torch import Tensor, nn

from .detr_core import (HeadOutputs, Proposals, SetPredictionHead, gather_rows, reg_mlp,
                         top_proposals)
from .detr_memory import Memory, Shape, flatten_levels, image_sizes
from .lwdetr_loss import GroupSetCriterion
from .lwdetr_transformer import LWDETRDecoder, LWDETRDecoderLayer, reparam_boxes, token_proposals


class Decoded(NamedTuple):
    """Every decoder layer's normed queries ``(L, B, G*Q, C)``, their reference boxes
    ``(B, G*Q, 4)`` and the proposals."""
    hidden: Tensor
    ref: Tensor
    proposals: Proposals


@MODELS.register_module()
class LWDETRHead(SetPredictionHead):
    """LW-DETR / RF-DETR head.

    Args:
        num_classes: foreground classes (RF-DETR's COCO checkpoints: 91 logits).
        embed_dims: channels of the maps (the projector's ``out_channels``) and queries.
        num_levels: maps given (RF-DETR's detection sizes: 1, P4).
        num_queries: queries per group (detections per image before top-k).
        num_groups: Group DETR query groups in training (RF-DETR: 13); 1 at test.
        num_decoder_layers: decoder layers (RF-DETR N: 2, S: 3, M / L: 4).
        self_heads, cross_heads, num_points: attention heads and deformable points
            (RF-DETR: 8, 16, 2).
        ffn_dims: decoder FFN channels (RF-DETR: 2048; no dropout, RF-DETR's 0).
        anchor_size: normalised side of the level-0 token anchors (doubling per level).
        dense_one_to_many: ``k``: add the one-to-many loss of every token's proposal
            (``enc_dense_`` terms, see the module docstring); None (RF-DETR's) leaves it out.
            Boxes only: ``LWDETRSegHead`` refuses it.
        train_cfg: ``dict(assigner=...)`` (Hungarian, focal 2 / L1 5 / GIoU 2 costs).
        loss_cls, loss_bbox, loss_iou: losses (IA-BCE 1, L1 5, GIoU 2).
        test_cfg: ``dict(max_per_img=300)`` (RF-DETR's ``num_select``).
        init_cfg: mmengine init config.
    """

    default_max_per_img: ClassVar[int] = 300
    criterion: GroupSetCriterion

    def __init__(self,
                 num_classes: int,
                 embed_dims: int = 256,
                 num_levels: int = 1,
                 num_queries: int = 300,
                 num_groups: int = 13,
                 num_decoder_layers: int = 3,
                 self_heads: int = 8,
                 cross_heads: int = 16,
                 num_points: int = 2,
                 ffn_dims: int = 2048,
                 anchor_size: float = 0.05,
                 dense_one_to_many: Optional[int] = None,
                 loss_cls: Optional[dict] = None,
                 loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None,
                 train_cfg: Optional[dict] = None,
                 test_cfg: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(num_classes, num_queries, embed_dims, anchor_size, train_cfg, test_cfg,
                         init_cfg)
        for name, value in (('num_groups', num_groups), ('num_levels', num_levels)):
            if value < 1:
                raise ValueError(f'{name} must be >= 1, got {value}')
        if dense_one_to_many is not None and dense_one_to_many < 1:
            raise ValueError(f'dense_one_to_many must be >= 1 (tokens per ground truth) or None,'
                             f' got {dense_one_to_many}')
        self.num_levels = num_levels
        self.num_groups = num_groups
        self.dense_one_to_many = dense_one_to_many
        self.decoder = LWDETRDecoder(num_decoder_layers, embed_dims, self_heads, cross_heads,
                                     num_levels, num_points, ffn_dims)
        total = num_queries * num_groups
        self.query_feat = nn.Embedding(total, embed_dims)
        self.refpoint_embed = nn.Embedding(total, 4)
        self.cls_branch = nn.Linear(embed_dims, num_classes)
        self.reg_branch = reg_mlp(embed_dims)
        # two-stage proposals: one set of layers per group
        self.enc_output = nn.ModuleList(nn.Linear(embed_dims, embed_dims)
                                        for _ in range(num_groups))
        self.enc_output_norm = nn.ModuleList(nn.LayerNorm(embed_dims) for _ in range(num_groups))
        self.enc_cls_branches = nn.ModuleList(nn.Linear(embed_dims, num_classes)
                                              for _ in range(num_groups))
        self.enc_reg_branches = nn.ModuleList(reg_mlp(embed_dims) for _ in range(num_groups))
        self.criterion = GroupSetCriterion(num_classes, self.train_cfg.get('assigner'),
                                           loss_cls, loss_bbox, loss_iou)
        self._init_head_weights()

    def _init_head_weights(self) -> None:
        """RF-DETR's init: Xavier decoder and proposal projections, deformable attention's
        own, prior-probability class biases, zero last box layers and reference deltas."""
        for p in [*self.decoder.parameters(), *self.enc_output.parameters()]:
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for layer in self.decoder.layers:
            cast(LWDETRDecoderLayer, layer).cross_attn.init_weights()
        self.init_branches([self.cls_branch, *self.enc_cls_branches],
                           [self.reg_branch, *self.enc_reg_branches])
        nn.init.zeros_(self.refpoint_embed.weight)

    # ------------------------------------------------------------------ forward
    def proposals(self, memory: Memory, num_groups: int) -> Proposals:
        """Two-stage proposals of the first ``num_groups`` groups (:class:`Proposals`: ``P``
        per group, ``num_queries`` or every token when there are fewer; dense ones with
        ``dense_one_to_many`` in training)."""
        anchors, usable = token_proposals(memory, self.anchor_size)            # (B, N, 4), (B, N)
        tokens = memory.tokens * usable[..., None].to(memory.tokens.dtype)
        dense = self.dense_one_to_many is not None and self.training
        refs, logits, boxes, inds, feats, dense_cls, dense_boxes = [], [], [], [], [], [], []
        for g in range(num_groups):
            hidden = self.enc_output_norm[g](self.enc_output[g](tokens))         # (B, N, C)
            cls = self.enc_cls_branches[g](hidden)                               # (B, N, K)
            top = top_proposals(cls.detach().max(-1).values, self.num_queries)  # (B, P)
            selected = gather_rows(hidden, top)                                  # (B, P, C)
            box = reparam_boxes(self.enc_reg_branches[g](selected), gather_rows(anchors, top))
            refs.append(box.detach())
            logits.append(gather_rows(cls, top))
            boxes.append(box)
            inds.append(top)
            feats.append(selected)
            if dense:
                dense_cls.append(cls)
                dense_boxes.append(reparam_boxes(self.enc_reg_branches[g](hidden), anchors))
        props = Proposals(torch.cat(refs, 1), torch.cat(logits, 1), torch.cat(boxes, 1),
                          torch.cat(inds, 1), torch.cat(feats, 1))
        if not dense:
            return props
        return props._replace(dense_cls=torch.cat(dense_cls, 1),                 # (B, G*N, K)
                              dense_boxes=torch.cat(dense_boxes, 1),             # (B, G*N, 4)
                              dense_unusable=(~usable).repeat(1, num_groups))    # (B, G*N)

    def forward(self, feats: Sequence[Tensor], batch_img_metas: Optional[Sequence[dict]] = None,
                batch_gt_instances: Optional[Sequence[InstanceData]] = None) -> HeadOutputs:
        """Predictions for the projector's maps ``feats`` (images described by mmdet
        ``batch_img_metas``; without them the batch is unpadded): :meth:`forward_images`. The
        ground truth (:class:`SetPredictionHead`'s interface) is not used: no denoising."""
        img_hw, batch_shape = image_sizes(batch_img_metas, feats[0].shape[0], feats[0].device,
                                          (int(feats[0].shape[-2]), int(feats[0].shape[-1])))
        return self.forward_images(feats, img_hw, batch_shape)

    def forward_images(self, feats: Sequence[Tensor], img_hw: Tensor,
                       batch_shape: Shape) -> HeadOutputs:
        """Every layer's ``(L, B, G*Q, K)`` logits and ``(L, B, G*Q, 4)`` cxcywh boxes and the
        proposals' (``G`` groups in training, one at test), for maps covering the padded batch
        ``batch_shape`` of images of ``img_hw`` ``(B, 2)`` (the exported graph's entry)."""
        return self.outputs(self.decode(feats, img_hw, batch_shape))

    def decode(self, feats: Sequence[Tensor], img_hw: Tensor, batch_shape: Shape) -> Decoded:
        """Proposals and the decoder on the projector's maps (see :meth:`forward_images`)."""
        if len(feats) != self.num_levels or any(x.shape[1] != self.embed_dims for x in feats):
            raise ValueError(f'{type(self).__name__} expects {self.num_levels} maps of '
                             f'{self.embed_dims} channels (num_levels, embed_dims), got '
                             f'{[tuple(x.shape) for x in feats]}')
        memory = flatten_levels(feats, img_hw, batch_shape)
        groups = self.num_groups if self.training else 1
        props = self.proposals(memory, groups)
        total = groups * self.num_queries
        proposed = props.ref.shape[1]                                           # G*P
        # fewer tokens than queries (P < Q): the rest keep their learned boxes (RF-DETR's rule)
        rest = self.refpoint_embed.weight[proposed:total]                       # (G*Q - G*P, 4)
        ref = torch.cat((reparam_boxes(self.refpoint_embed.weight[:proposed], props.ref),
                         rest.expand(props.ref.shape[0], -1, -1)), 1)           # (B, G*Q, 4)
        query = self.query_feat.weight[:total].expand(ref.shape[0], -1, -1)     # (B, G*Q, C)
        hidden = self.decoder(query.to(memory.tokens.dtype), ref, memory, groups)
        return Decoded(hidden, ref, props)

    def outputs(self, decoded: Decoded) -> HeadOutputs:
        """Every layer's class logits and boxes, and the proposals' (see :meth:`forward`)."""
        boxes = reparam_boxes(self.reg_branch(decoded.hidden), decoded.ref)     # (L, B, G*Q, 4)
        return decoded.proposals.outputs(self.cls_branch(decoded.hidden), boxes)

    # ------------------------------------------------------------------ training
    def loss_by_feat(self, outs: HeadOutputs, batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict],
                     layer_kwargs: Optional[Sequence[Dict[str, Any]]] = None,
                     enc_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Tensor]:
        """Group losses of every decoder layer (``d{i}.`` prefixes for the earlier layers)
        and of the proposals (``enc_`` prefix); ``layer_kwargs[i]`` / ``enc_kwargs``: more
        criterion arguments for decoder layer ``i`` / the proposals (a subclass's)."""
        if outs.enc_cls_scores is None or outs.enc_bbox_preds is None:
            raise ValueError('LWDETRHead outputs carry the two-stage proposals; got none')
        groups = outs.all_cls_scores.shape[2] // self.num_queries
        losses = self.layer_losses(outs.all_cls_scores, outs.all_bbox_preds,
                                   batch_gt_instances, batch_img_metas,
                                   layer_kwargs=layer_kwargs, num_groups=groups)
        enc = self.criterion(outs.enc_cls_scores, outs.enc_bbox_preds, batch_gt_instances,
                             batch_img_metas, num_groups=groups, **(enc_kwargs or {}))
        losses.update({'enc_' + k: v for k, v in enc.items()})
        if outs.dense_cls_scores is not None and self.dense_one_to_many is not None:
            losses.update({'enc_dense_' + k: v for k, v in self.one_to_many_losses(
                outs, batch_gt_instances, batch_img_metas, self.dense_one_to_many,
                groups).items()})
        return losses
