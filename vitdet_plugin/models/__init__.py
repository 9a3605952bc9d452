"""Models registered into mmdet's ``MODELS`` registry (importing registers them)."""
from . import backbones, layers  # noqa: F401
from . import necks  # noqa: F401

from . import detectors, heads  # noqa: F401
from . import losses  # noqa: F401
