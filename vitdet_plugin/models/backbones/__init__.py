"""Backbones (each exposes ``out_channels`` / ``out_strides``)."""
from .swin import SwinBackbone

__all__ = ['SwinBackbone']
