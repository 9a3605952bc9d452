"""vitdet_plugin: Swin and plain-ViT (ViTDet) backbones for MMDetection 3.x.

``import vitdet_plugin`` (or ``custom_imports = dict(imports=['vitdet_plugin'])`` in a config)
does two separate things:

* :func:`vitdet_plugin.compat.apply` makes every change to other libraries, in one place: the
  compile-free mmcv ops where mmcv has no compiled extension, the OpenMMLab stack check, safe
  checkpoint loading for torch and mmengine, and the bf16 fix of compiled mmcv's ``nms`` /
  ``roi_align`` (see :mod:`vitdet_plugin.compat`);
* importing :mod:`.weights` plugs the checkpoint loader into the contract the models call
  (:mod:`vitdet_plugin.functional.checkpoint_target`); importing :mod:`.models`,
  :mod:`.datasets`, :mod:`.engine` and :mod:`.checks` registers our modules (and the checks
  run before training) in mmdet's and mmengine's registries under our own names.

Without torch (a deployment install: numpy + onnxruntime), the import does neither and only
:mod:`vitdet_plugin.deploy.runner` is usable (it runs an exported end-to-end graph).
"""
import importlib.util

from .version import __version__

if importlib.util.find_spec('torch') is not None:
    from . import compat

    compat.apply()  # the import-time patches, before anything below imports mmcv.ops

    from . import weights  # noqa: F401  (plugs the checkpoint loader the models call)
    from . import models  # (registers modules)
    from . import datasets  # noqa: F401  (registers RF-DETR's transforms and batch scale)
    from . import engine  # noqa: F401  (registers the optimizer constructor and hooks)
    from . import checks  # noqa: F401  (registers PreflightCheckHook)

__all__ = ['__version__', 'compat', 'models']
