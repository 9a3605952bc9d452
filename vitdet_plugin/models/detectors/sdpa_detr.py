"""``SdpaDETR``: backbone (+ optional neck) + :class:`SdpaDETRHead`.

A thin :class:`~mmdet.models.detectors.SingleStageDetector`: the head owns the transformer.
Additions:

* every data sample carries ``batch_input_shape`` and ``img_shape`` (the head needs them for
  padding masks and box normalisation), as mmdet's ``DetectionTransformer`` does, so the model
  also works when samples come without the ``DetDataPreprocessor`` metadata (hand-built
  batches);
* the Pretrained ``init_cfg`` of every part is loaded strictly and reported, also for parts
  (mmdet's ``FPN``, the head) that mmengine would load non-strictly (see
  :mod:`.pretrained_parts`): a head trained on another detector's backbone and neck starts
  from exactly their weights;
* ``frozen_parts``: train the head on a pretrained backbone / neck kept fixed (no gradients,
  eval mode), e.g. ``frozen_parts=('backbone', 'neck')``.
"""
from typing import Any, Sequence, Tuple, Union

from mmdet.models.detectors import SingleStageDetector
from mmdet.registry import MODELS
from mmdet.structures import OptSampleList, SampleList
from torch import Tensor, nn

from .pretrained_parts import init_weights_with_strict_parts

#: The parts ``frozen_parts`` may name.
FREEZABLE_PARTS = ('backbone', 'neck')


@MODELS.register_module()
class SdpaDETR(SingleStageDetector):
    """DETR-style detector whose head runs its own SDPA transformer (see ``SdpaDETRHead``).

    Args:
        frozen_parts: parts of the detector (``'backbone'``, ``'neck'``) whose parameters get
            no gradients and which stay in eval mode (batch-norm statistics fixed) in training.
        Others: as :class:`~mmdet.models.detectors.SingleStageDetector` (``neck`` optional).
    """

    def __init__(self, *args: Any, frozen_parts: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(frozen_parts, str):
            raise TypeError(f'frozen_parts must be a sequence of part names, got the string '
                            f'{frozen_parts!r}; write frozen_parts=({frozen_parts!r},)')
        unknown = [p for p in frozen_parts if p not in FREEZABLE_PARTS]
        if unknown:
            raise ValueError(f'frozen_parts={tuple(frozen_parts)}: {unknown} cannot be frozen; '
                             f'choose from {FREEZABLE_PARTS}')
        if 'neck' in frozen_parts and not self.with_neck:
            raise ValueError("frozen_parts names 'neck' but the detector has none (neck=None)")
        self.frozen_parts = tuple(frozen_parts)
        for part in self._frozen_modules():
            part.requires_grad_(False)

    def _frozen_modules(self) -> Tuple[nn.Module, ...]:
        return tuple(getattr(self, p) for p in self.frozen_parts)

    def init_weights(self) -> None:
        init_weights_with_strict_parts(self, super().init_weights)

    def train(self, mode: bool = True) -> 'SdpaDETR':
        super().train(mode)
        for part in self._frozen_modules():
            part.eval()
        return self

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
