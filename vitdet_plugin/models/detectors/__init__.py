"""Detectors (registered in mmdet's ``MODELS``)."""
from .sdpa_detr import SdpaDETR

__all__ = ['SdpaDETR']
