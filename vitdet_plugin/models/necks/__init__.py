"""Necks (each exposes ``out_channels`` / ``out_strides``)."""
from .simple_fpn import ViTSimpleFPN

__all__ = ['ViTSimpleFPN']
