"""``mmcv._ext.get_compiler_version`` / ``get_compiling_cuda_version`` for the compile-free ops.

mmcv's ``collect_env`` (and mmdet's, printed at the start of every run) reports these; here they
say which backend runs the ops instead of naming a compiler.
"""
import torch
import torchvision

#: What ``get_compiler_version`` reports.
COMPILER = 'none (vitdet_plugin compile-free ops: torchvision {tv} / PyTorch {torch})'
#: What ``get_compiling_cuda_version`` reports: mmcv's own word for "built without CUDA", as the
#: CUDA paths of these ops come from torch / torchvision, not from a build of ours.
NO_CUDA_BUILD = 'not available'


def get_compiler_version() -> str:
    return COMPILER.format(tv=torchvision.__version__, torch=torch.__version__)


def get_compiling_cuda_version() -> str:
    return NO_CUDA_BUILD
