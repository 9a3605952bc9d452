"""Detection heads (registered in mmdet's ``MODELS``)."""
from .denoising import DenoisingBatch, DenoisingQueries
from .lwdetr_head import LWDETRHead
from .lwdetr_seg_head import LWDETRSegHead
from .maskformer_semantic import SemanticMaskFormerFusionHead, semantic_inference
from .multiscale_memory import FlatMemory, MultiScaleMemory
from .detr_core import HeadOutputs, SetPredictionHead
from .detr_memory import Memory
from .dfine_decoder import DFineDecoder, DFineQuerySelector
from .dfine_head import DFineHead
from .sdpa_detr_head import SdpaDETRHead
from .set_criterion import SetCriterion
from .transformer import BoxAttentionPrior, MemoryEncoder, RefineDecoder, TransformerLayer

__all__ = [
    'DenoisingBatch', 'DenoisingQueries', 'FlatMemory', 'MultiScaleMemory', 'HeadOutputs',
    'SetPredictionHead', 'Memory',
    'SdpaDETRHead', 'SetCriterion', 'BoxAttentionPrior', 'MemoryEncoder', 'RefineDecoder',
    'TransformerLayer', 'SemanticMaskFormerFusionHead', 'semantic_inference', 'LWDETRHead',
    'LWDETRSegHead', 'DFineHead', 'DFineDecoder', 'DFineQuerySelector'
]
