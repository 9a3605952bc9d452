"""MaskFormer / Mask2Former fusion head that also gives the semantic map (``pred_sem_seg``).

mmdet 3.3's :class:`~mmdet.models.seg_heads.MaskFormerFusionHead` leaves semantic inference
out: its ``predict`` asserts ``test_cfg.semantic_on`` is False, ``semantic_postprocess`` raises
``NotImplementedError`` and :meth:`MaskFormer.add_pred_to_datasample` asserts there is no
``'sem_results'`` entry. :class:`SemanticMaskFormerFusionHead` keeps the panoptic and instance
outputs of the stock head unchanged and adds the semantic inference of the MaskFormer /
Mask2Former papers (:func:`semantic_inference`): per class, the sum over queries of the class
probability (no-object column dropped) times the sigmoid mask, then the per-pixel argmax.

With ``semantic_on=True`` the map (``(1, H, W)`` int64 labels at the image size, or
``ori_shape`` with ``rescale``) is written to each data sample as ``pred_sem_seg``, the field
mmdet's :class:`~mmdet.evaluation.SemSegMetric` reads; the detector itself is mmdet's.

Config::

    panoptic_fusion_head=dict(type='SemanticMaskFormerFusionHead', num_things_classes=80,
                              num_stuff_classes=53)
    test_cfg=dict(panoptic_on=True, semantic_on=True, instance_on=True, ...)
"""
from typing import Any, List, Mapping

import torch
import torch.nn.functional as F
from mmdet.models.seg_heads.panoptic_fusion_heads import MaskFormerFusionHead
from mmdet.registry import MODELS
from mmdet.structures import SampleList
from mmengine.structures import PixelData
from torch import Tensor


def semantic_inference(mask_cls: Tensor, mask_pred: Tensor) -> Tensor:
    """Per-class scores of one image: ``einsum('qc,qhw->chw', softmax(cls)[:, :-1],
    sigmoid(mask))``.

    Args:
        mask_cls: ``(Q, C + 1)`` classification logits (the last column is "no object").
        mask_pred: ``(Q, H, W)`` mask logits.

    Returns:
        ``(C, H, W)`` scores; their argmax over ``C`` is the semantic map.
    """
    if mask_cls.dim() != 2 or mask_pred.dim() != 3 or mask_cls.shape[0] != mask_pred.shape[0]:
        raise ValueError(f'expected (Q, C + 1) class logits and (Q, H, W) mask logits, got '
                         f'{tuple(mask_cls.shape)} and {tuple(mask_pred.shape)}')
    class_probs = F.softmax(mask_cls, dim=-1)[:, :-1]                # (Q, C)
    return torch.einsum('qc,qhw->chw', class_probs, mask_pred.sigmoid())


def image_mask_logits(mask_pred: Tensor, img_meta: Mapping[str, Any], rescale: bool) -> Tensor:
    """``(Q, Hpad, Wpad)`` mask logits of a padded batch -> ``(Q, h, w)`` of the image: padding
    cropped at ``img_shape``, then bilinearly resized to ``ori_shape`` with ``rescale`` (as
    mmdet's :meth:`MaskFormerFusionHead.predict`)."""
    img_h, img_w = img_meta['img_shape'][:2]
    mask_pred = mask_pred[:, :img_h, :img_w]
    if rescale:
        ori_h, ori_w = img_meta['ori_shape'][:2]
        mask_pred = F.interpolate(mask_pred[:, None], size=(ori_h, ori_w), mode='bilinear',
                                  align_corners=False)[:, 0]
    return mask_pred


@MODELS.register_module()
class SemanticMaskFormerFusionHead(MaskFormerFusionHead):
    """:class:`MaskFormerFusionHead` with semantic inference (see the module docstring).

    ``test_cfg`` keys: ``panoptic_on`` (default True), ``instance_on``, ``semantic_on``
    (default False) and the stock head's thresholds.
    """

    def semantic_postprocess(self, mask_cls: Tensor, mask_pred: Tensor) -> PixelData:
        """``(Q, C + 1)`` class logits, ``(Q, H, W)`` mask logits -> ``PixelData`` with
        ``sem_seg``: ``(1, H, W)`` int64 class indices in ``[0, C)``."""
        scores = semantic_inference(mask_cls, mask_pred)
        return PixelData(sem_seg=scores.argmax(dim=0, keepdim=True))

    def predict(self,
                mask_cls_results: Tensor,
                mask_pred_results: Tensor,
                batch_data_samples: SampleList,
                rescale: bool = False,
                **kwargs: Any) -> List[dict]:
        """Per image: ``{'pan_results': PixelData, 'ins_results': InstanceData}`` (as enabled
        in ``test_cfg``); with ``semantic_on`` each data sample also gets ``pred_sem_seg``.

        Args:
            mask_cls_results: ``(B, Q, C + 1)`` class logits of the last decoder layer.
            mask_pred_results: ``(B, Q, Hpad, Wpad)`` mask logits at the padded input size.
            batch_data_samples: the batch's data samples (their metainfo gives the sizes).
            rescale: return results at ``ori_shape`` instead of ``img_shape``.
        """
        test_cfg = self.test_cfg or {}
        panoptic_on = test_cfg.get('panoptic_on', True)
        instance_on = test_cfg.get('instance_on', False)
        semantic_on = test_cfg.get('semantic_on', False)
        results = []
        for mask_cls, mask_pred, data_sample in zip(mask_cls_results, mask_pred_results,
                                                    batch_data_samples):
            mask_pred = image_mask_logits(mask_pred, data_sample.metainfo, rescale)
            result = {}
            if panoptic_on:
                result['pan_results'] = self.panoptic_postprocess(mask_cls, mask_pred)
            if instance_on:
                result['ins_results'] = self.instance_postprocess(mask_cls, mask_pred)
            if semantic_on:
                # mmdet 3.3's MaskFormer.add_pred_to_datasample copies only the panoptic and
                # instance results (and rejects 'sem_results'): the map goes on the sample here
                data_sample.pred_sem_seg = self.semantic_postprocess(mask_cls, mask_pred)
            results.append(result)
        return results
