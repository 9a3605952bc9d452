"""Stand in for mmcv's compiled extension (``mmcv._ext``) when it is absent.

Standard library only: ``vitdet_plugin-mmcv-ops.pth`` (installed with the package) loads this
file at interpreter start, so the stand-in is in place before anything imports ``mmcv.ops``:
mmdet's ``tools/train.py``, ``mim train``, ``mmdet.apis.init_detector`` and a plain ``import
mmdet.models`` alike. ``import vitdet_plugin`` installs it too (for an interpreter started
without site-packages processing).

The finder answers only the import of ``mmcv._ext``, and by the ``VITDET_MMCV_OPS`` variable:

* ``auto`` (default): mmcv's compiled extension when it is installed, else the compile-free ops;
* ``torch``: the compile-free ops even where compiled mmcv is installed;
* ``off``: never the stand-in (mmcv without its extension fails as it always did).

The module it creates resolves each function on first call through
:mod:`vitdet_plugin.ops.registry` (so importing ``mmcv.ops`` imports nothing of ours).
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any, Callable, Optional, Sequence

ENV_VAR = 'VITDET_MMCV_OPS'
MODES = ('auto', 'torch', 'off')
DEFAULT_MODE = 'auto'
EXT_NAME = 'mmcv._ext'
#: ``origin`` of the stand-in module's spec and its ``BACKEND`` attribute.
BACKEND = 'vitdet_plugin.ops'
#: attribute that marks our finder on ``sys.meta_path`` (this file may be loaded twice: by the
#: .pth file under another module name and as ``vitdet_plugin.ops.startup``)
MARKER = '_vitdet_plugin_ops_finder'


def mode() -> str:
    """The ``VITDET_MMCV_OPS`` mode; an unknown value is an error naming the choices."""
    value = os.environ.get(ENV_VAR, DEFAULT_MODE).strip().lower() or DEFAULT_MODE
    if value not in MODES:
        raise ImportError(f'{ENV_VAR}={value!r} is not one of {", ".join(MODES)} (auto: compiled '
                          f'mmcv ops when installed, else vitdet_plugin\'s compile-free ops)')
    return value


def compiled_ext_spec(path: Optional[Sequence[str]]) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of mmcv's own compiled ``_ext`` on ``path`` (mmcv's ``__path__``), if any."""
    return importlib.machinery.PathFinder.find_spec(EXT_NAME, path)


class _LazyOp:
    """``mmcv._ext.<name>``: resolved to its implementation at the first call."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name
        self._impl: Optional[Callable[..., Any]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._impl is None:
            registry = importlib.import_module('vitdet_plugin.ops.registry')
            self._impl = registry.resolve(self.__name__)
        return self._impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f'<mmcv._ext.{self.__name__} from {BACKEND}>'


def _ext_getattr(module: types.ModuleType) -> Callable[[str], _LazyOp]:
    def __getattr__(name: str) -> _LazyOp:  # PEP 562: every public name is an op
        if name.startswith('_'):
            raise AttributeError(f'module {EXT_NAME!r} has no attribute {name!r}')
        op = _LazyOp(name)
        setattr(module, name, op)
        return op
    return __getattr__


class _ExtLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = ('Compile-free stand-in for mmcv\'s compiled extension '
                          '(vitdet_plugin.ops; VITDET_MMCV_OPS selects the backend).')
        module.BACKEND = BACKEND  # type: ignore[attr-defined]
        module.__getattr__ = _ext_getattr(module)  # type: ignore[method-assign]


class CompileFreeOpsFinder(importlib.abc.MetaPathFinder):
    """Meta path finder that answers ``import mmcv._ext`` with the compile-free ops."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != EXT_NAME:
            return None
        selected = mode()
        if selected == 'off' or (selected == 'auto' and compiled_ext_spec(path) is not None):
            return None  # mmcv's own extension (or mmcv's own import error)
        return importlib.machinery.ModuleSpec(EXT_NAME, _ExtLoader(), origin=BACKEND)


setattr(CompileFreeOpsFinder, MARKER, True)


def new_ext_module() -> types.ModuleType:
    """A new compile-free ``mmcv._ext`` module, not registered anywhere: what the finder's
    loader creates, for comparing the two backends in one process (``tools/dev/bench/ops.py``)."""
    module = types.ModuleType(EXT_NAME)
    _ExtLoader().exec_module(module)
    return module


def installed() -> bool:
    """Is a compile-free ops finder on ``sys.meta_path``?"""
    return any(getattr(f, MARKER, False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not installed():
        sys.meta_path.insert(0, CompileFreeOpsFinder())
