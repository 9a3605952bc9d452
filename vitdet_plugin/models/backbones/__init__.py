"""Backbones (each exposes ``out_channels`` / ``out_strides``)."""
from .swin import SwinBackbone
from .vit import ViTBackbone

__all__ = ['SwinBackbone', 'ViTBackbone']
