"""vitdet_plugin: Swin and plain-ViT (ViTDet) backbones for MMDetection 3.x.

``import vitdet_plugin`` (or ``custom_imports = dict(imports=['vitdet_plugin'])`` in a config)
puts the compile-free mmcv ops in place where mmcv has no compiled extension (``vitdet_plugin.ops``;
the package's .pth hook does the same at interpreter start), checks the OpenMMLab stack, installs
the torch/mmengine checkpoint-loading fix and registers our modules (and the checks run before
training, ``vitdet_plugin.checks``) in mmdet's and mmengine's registries under our own names.
"""
from .ops import startup as _ops_startup

_ops_startup.install()  # before anything below imports mmcv.ops

from . import compat  # noqa: E402
from .version import __version__  # noqa: E402

compat.apply()

from . import models  # noqa: E402  (registers modules)
from . import engine  # noqa: E402,F401  (registers the optimizer constructor)
from . import checks  # noqa: E402,F401  (registers PreflightCheckHook)

__all__ = ['__version__', 'compat', 'models']
