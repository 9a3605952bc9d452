"""Panoptic FPN that reports all three segmentation outputs of one forward pass.

mmdet 3.3's :class:`~mmdet.models.detectors.PanopticFPN` (a Mask R-CNN with a semantic FPN
head and a heuristic fusion) keeps only the fused panoptic map: its ``predict`` throws the
instance results away after the fusion, and no panoptic model of mmdet writes the semantic map
that :class:`~mmdet.evaluation.SemSegMetric` reads. :class:`AllOutputsPanopticFPN` is the same
model (same losses, same modules, same checkpoints) whose ``predict`` writes

* ``pred_instances``: the Mask R-CNN detections (boxes, scores, labels, masks) at the
  low ``test_cfg.rcnn.score_thr`` COCO mAP wants, for :class:`~mmdet.evaluation.CocoMetric`;
* ``pred_panoptic_seg``: mmdet's heuristic fusion of the instances scoring at least
  ``test_cfg.panoptic.instance_score_thr`` with the stuff map, for
  :class:`~mmdet.evaluation.CocoPanopticMetric` (mmdet's PanopticFPN uses one threshold for
  both, 0.6, which discards most of the detections mAP counts);
* ``pred_sem_seg``: the panoptic map's class of every pixel (things and stuff; pixels the
  fusion leaves void get :data:`IGNORE_INDEX`, which ``SemSegMetric`` counts as wrong wherever
  the ground truth has a class, and mmdet's visualizer leaves undrawn).

So one trained model gives segm mAP, PQ and mIoU in one evaluation pass.
"""
from typing import List

from mmdet.evaluation.functional import INSTANCE_OFFSET
from mmdet.models.detectors import PanopticFPN
from mmdet.registry import MODELS
from mmdet.structures import SampleList
from mmdet.utils import InstanceList
from mmengine.structures import PixelData
from torch import Tensor

#: Label of void pixels in ``pred_sem_seg`` (mmdet's / mmseg's ignore index).
IGNORE_INDEX = 255
#: Default score a detection needs to enter the panoptic fusion (mmdet's PanopticFPN configs).
PANOPTIC_INSTANCE_SCORE_THR = 0.6


@MODELS.register_module()
class AllOutputsPanopticFPN(PanopticFPN):
    """:class:`~mmdet.models.detectors.PanopticFPN` whose ``predict`` keeps the instances and
    adds the semantic map (see the module docstring). Config: ``type='AllOutputsPanopticFPN'``
    and ``test_cfg.panoptic.instance_score_thr`` (default
    :data:`PANOPTIC_INSTANCE_SCORE_THR`)."""

    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                rescale: bool = True) -> SampleList:
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        feats = self.extract_feat(batch_inputs)
        if batch_data_samples[0].get('proposals', None) is None:
            proposals = self.rpn_head.predict(feats, batch_data_samples, rescale=False)
        else:
            proposals = [sample.proposals for sample in batch_data_samples]
        instances: InstanceList = self.roi_head.predict(feats, proposals, batch_data_samples,
                                                        rescale=rescale)
        seg_preds = self.semantic_head.predict(feats, batch_img_metas, rescale)
        thr = self.test_cfg.get('panoptic', {}).get('instance_score_thr',
                                                   PANOPTIC_INSTANCE_SCORE_THR)
        confident = [inst[inst.scores >= thr] for inst in instances]
        panoptic: List[PixelData] = self.panoptic_fusion_head.predict(confident, seg_preds)
        for sample, inst, pan in zip(batch_data_samples, instances, panoptic):
            sample.pred_instances = inst
            sample.pred_panoptic_seg = pan
            labels = pan.sem_seg % INSTANCE_OFFSET  # (1, H, W): label + index * INSTANCE_OFFSET
            labels[labels == self.num_classes] = IGNORE_INDEX  # the fusion's void
            sample.pred_sem_seg = PixelData(sem_seg=labels, metainfo=dict(
                ignore_index=IGNORE_INDEX))
        return batch_data_samples
