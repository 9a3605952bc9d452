"""Necks (each exposes ``out_channels`` / ``out_strides``)."""
from .hybrid_encoder import HybridEncoder
from .lite_encoder import LiteEncoder
from .rfdetr_projector import RFDETRProjector
from .simple_fpn import ViTSimpleFPN

__all__ = ['HybridEncoder', 'LiteEncoder', 'RFDETRProjector', 'ViTSimpleFPN']
