"""vitdet_plugin: Swin and plain-ViT (ViTDet) backbones for MMDetection 3.x.

``import vitdet_plugin`` (or ``custom_imports = dict(imports=['vitdet_plugin'])`` in a config)
checks the OpenMMLab stack, installs the torch/mmengine checkpoint-loading fix and registers
our modules in mmdet's and mmengine's registries under our own names.
"""
from . import compat
from .version import __version__

compat.apply()

from . import models  # noqa: E402  (registers modules)
from . import engine  # noqa: E402,F401  (registers the optimizer constructor)

__all__ = ['__version__', 'compat', 'models']
