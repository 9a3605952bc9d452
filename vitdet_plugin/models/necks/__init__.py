"""Necks (each exposes ``out_channels`` / ``out_strides``)."""
from .rfdetr_projector import RFDETRProjector
from .simple_fpn import ViTSimpleFPN

__all__ = ['RFDETRProjector', 'ViTSimpleFPN']
