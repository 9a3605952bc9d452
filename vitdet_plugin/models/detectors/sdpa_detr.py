"""``SdpaDETR``: backbone (+ optional neck) + :class:`SdpaDETRHead`.

A thin :class:`~mmdet.models.detectors.SingleStageDetector`: the head owns the transformer.
The only addition is making sure every data sample carries ``batch_input_shape`` and
``img_shape`` (the head needs them for padding masks and box normalisation), as mmdet's
``DetectionTransformer`` does, so the model also works when samples come without the
``DetDataPreprocessor`` metadata (e.g. hand-built batches).
"""
from typing import Tuple, Union

from mmdet.models.detectors import SingleStageDetector
from mmdet.registry import MODELS
from mmdet.structures import OptSampleList, SampleList
from torch import Tensor


@MODELS.register_module()
class SdpaDETR(SingleStageDetector):
    """DETR-style detector whose head runs its own SDPA transformer (see ``SdpaDETRHead``).

    Args: as :class:`~mmdet.models.detectors.SingleStageDetector` (``neck`` optional).
    """

    @staticmethod
    def _complete_metainfo(batch_inputs: Tensor, batch_data_samples: OptSampleList) -> None:
        if not batch_data_samples:
            return
        shape = tuple(batch_inputs.shape[-2:])
        for sample in batch_data_samples:
            if 'batch_input_shape' not in sample.metainfo:
                sample.set_metainfo(dict(batch_input_shape=shape))
            if 'img_shape' not in sample.metainfo:
                sample.set_metainfo(dict(img_shape=shape))

    def loss(self, batch_inputs: Tensor, batch_data_samples: SampleList) -> Union[dict, list]:
        self._complete_metainfo(batch_inputs, batch_data_samples)
        return super().loss(batch_inputs, batch_data_samples)

    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList,
                rescale: bool = True) -> SampleList:
        self._complete_metainfo(batch_inputs, batch_data_samples)
        return super().predict(batch_inputs, batch_data_samples, rescale=rescale)

    def _forward(self, batch_inputs: Tensor,
                 batch_data_samples: OptSampleList = None) -> Tuple[Tensor, ...]:
        self._complete_metainfo(batch_inputs, batch_data_samples)
        metas = None if not batch_data_samples else [s.metainfo for s in batch_data_samples]
        return self.bbox_head.forward(self.extract_feat(batch_inputs), metas)
