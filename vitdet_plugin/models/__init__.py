"""Models registered into mmdet's ``MODELS`` registry (importing registers them)."""
from . import backbones, layers  # noqa: F401
