"""Detectors (registered in mmdet's ``MODELS``)."""
from .panoptic_fpn import AllOutputsPanopticFPN
from .sdpa_detr import SdpaDETR

__all__ = ['AllOutputsPanopticFPN', 'SdpaDETR']
