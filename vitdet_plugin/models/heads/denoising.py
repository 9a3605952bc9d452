"""Contrastive denoising queries (DN-DETR / DINO), a training-only convergence aid.

Ground-truth boxes and labels are noised and fed to the decoder as extra queries whose targets
are known, so the decoder learns box refinement without waiting for Hungarian matching to
settle. Each group holds one *positive* query per object (box noise below ``box_noise_scale``
half-sizes, trained to reconstruct the object) and one *negative* query (noise between one and
two times that, trained as background). Groups cannot see each other and the matching queries
cannot see any denoising query (an additive ``-inf`` self-attention bias).
"""
from typing import List, NamedTuple, Sequence, Tuple

import torch
from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
from mmengine.structures import InstanceData
from torch import Tensor, nn


class DenoisingBatch(NamedTuple):
    """Denoising queries of a batch.

    Attributes:
        query: content ``(B, D, C)`` (embedded noised labels).
        ref_boxes: noised boxes ``(B, D, 4)``, normalised cxcywh.
        self_bias: ``(1, 1, D + Q, D + Q)`` self-attention bias for ``[denoising; matching]``.
        matches: per image ``(query_inds, gt_inds)`` of the positive queries (indices in ``D``).
    """
    query: Tensor
    ref_boxes: Tensor
    self_bias: Tensor
    matches: List[Tuple[Tensor, Tensor]]

    @property
    def num_queries(self) -> int:
        return self.query.shape[1]


class DenoisingQueries(nn.Module):
    """Builds :class:`DenoisingBatch` from the ground truth.

    Args:
        num_classes: foreground classes.
        embed_dims: query channels.
        num_dn_queries: target number of positive queries per image; the number of groups is
            ``max(1, num_dn_queries // max_objects_in_batch)`` (DINO's dynamic groups).
        label_noise_scale: twice the probability of replacing a label by a random class.
        box_noise_scale: box noise in half box sizes (positives below, negatives up to twice).
    """

    def __init__(self, num_classes: int, embed_dims: int, num_dn_queries: int = 100,
                 label_noise_scale: float = 0.5, box_noise_scale: float = 1.0) -> None:
        super().__init__()
        if num_dn_queries < 1:
            raise ValueError(f'num_dn_queries must be >= 1, got {num_dn_queries}')
        if not 0 <= label_noise_scale <= 1 or box_noise_scale < 0:
            raise ValueError(f'label_noise_scale must be in [0, 1] and box_noise_scale >= 0, '
                             f'got {label_noise_scale} and {box_noise_scale}')
        self.num_classes = num_classes
        self.num_dn_queries = num_dn_queries
        self.label_noise_scale = label_noise_scale
        self.box_noise_scale = box_noise_scale
        self.label_embedding = nn.Embedding(num_classes, embed_dims)

    def forward(self, batch_gt_instances: Sequence[InstanceData],
                batch_img_metas: Sequence[dict], num_matching: int) -> DenoisingBatch:
        """Denoising queries for a batch.

        A batch without any object still gets one group of (padding, background) queries:
        every rank then runs the same graph and the same loss collectives (DDP without
        ``find_unused_parameters``), and the loss keys stay the same.
        """
        max_gts = max(len(g) for g in batch_gt_instances)
        device = self.label_embedding.weight.device
        groups = max(1, self.num_dn_queries // max_gts) if max_gts else 1
        max_gts = max(max_gts, 1)
        per_group = 2 * max_gts                      # positives then negatives, padded
        d = groups * per_group
        b = len(batch_gt_instances)
        labels = torch.zeros(b, d, dtype=torch.long, device=device)
        boxes = torch.zeros(b, d, 4, device=device)
        boxes[..., :2] = 0.5
        boxes[..., 2:] = 1.0 / max(per_group, 1)     # padding: harmless small central boxes
        matches = []
        for i, (gt, meta) in enumerate(zip(batch_gt_instances, batch_img_metas)):
            n = len(gt)
            if n == 0:
                empty = torch.zeros(0, dtype=torch.long, device=device)
                matches.append((empty, empty))
                continue
            img_h, img_w = meta['img_shape'][:2]
            scale = torch.tensor([img_w, img_h, img_w, img_h], dtype=torch.float32,
                                 device=device)
            xyxy = (gt.bboxes.to(device).float() / scale).clamp(0, 1)    # (n, 4)
            gt_labels = gt.labels.to(device)
            # (groups, 2, n): [positive, negative] copies
            xyxy = xyxy[None, None].expand(groups, 2, n, 4)
            wh = (xyxy[..., 2:] - xyxy[..., :2]).repeat(1, 1, 1, 2) / 2
            part = torch.rand(groups, 2, n, 4, device=device)
            part[:, 1] += 1.0
            sign = torch.randint(0, 2, part.shape, device=device) * 2.0 - 1.0
            noised = (xyxy + sign * part * wh * self.box_noise_scale).clamp(0, 1)
            lab = gt_labels[None, None].expand(groups, 2, n).clone()
            flip = torch.rand(lab.shape, device=device) < self.label_noise_scale * 0.5
            lab[flip] = torch.randint(0, self.num_classes, (int(flip.sum()),), device=device)
            slots = (torch.arange(groups, device=device)[:, None, None] * per_group
                     + torch.arange(2, device=device)[None, :, None] * max_gts
                     + torch.arange(n, device=device)[None, None, :])          # (g, 2, n)
            boxes[i, slots.flatten()] = bbox_xyxy_to_cxcywh(noised.reshape(-1, 4))
            labels[i, slots.flatten()] = lab.flatten()
            matches.append((slots[:, 0].flatten(),
                            torch.arange(n, device=device).repeat(groups)))
        # degenerate (zero-size) noised boxes would make inverse_sigmoid saturate: keep >= eps
        boxes[..., 2:] = boxes[..., 2:].clamp(min=1e-3)
        return DenoisingBatch(self.label_embedding(labels), boxes,
                              self._self_bias(groups, per_group, num_matching, device), matches)

    @staticmethod
    def _self_bias(groups: int, per_group: int, num_matching: int,
                   device: torch.device) -> Tensor:
        d = groups * per_group
        t = d + num_matching
        blocked = torch.zeros(t, t, dtype=torch.bool, device=device)
        blocked[d:, :d] = True                               # matching cannot see denoising
        group = torch.arange(d, device=device) // per_group
        blocked[:d, :d] = group[:, None] != group[None, :]   # groups cannot see each other
        bias = torch.zeros(t, t, device=device).masked_fill_(blocked, float('-inf'))
        return bias[None, None]

    def extra_repr(self) -> str:
        return (f'num_dn_queries={self.num_dn_queries}, label_noise_scale='
                f'{self.label_noise_scale}, box_noise_scale={self.box_noise_scale}')


def split_outputs(x: Tensor, num_dn: int) -> Tuple[Tensor, Tensor]:
    """``(..., D + Q, k)`` -> denoising ``(..., D, k)`` and matching ``(..., Q, k)`` parts."""
    return x[..., :num_dn, :], x[..., num_dn:, :]

