"""Build only the mmcv CUDA ops the checked detectors need (an unpacked mmcv 2.1.0 sdist).

mmcv's CUDA build compiles 58 ``.cu`` kernels on top of the 77 C++ files of its CPU build. The
checked configs call three CUDA ops: sigmoid focal loss (RetinaNet's loss), NMS (RetinaNet and
RPN post-processing) and RoIAlign (Mask R-CNN's RoI heads). Pruning keeps every C++ file, so
``mmcv.ops`` imports, the Python bindings exist and every op still runs on CPU, and keeps only
the kernels of :data:`NEEDED_OPS` and their registrations in ``cudabind.cpp``; an op without
its kernel raises mmcv's own "not implemented for CUDA" error if called on a GPU tensor.

``cudabind.cpp`` is a sequence of top-level items: prototypes of the kernel launchers
(defined in the ops' ``.cu`` files), wrapper functions calling them, prototypes of the
``*_impl`` dispatch entries (defined by mmcv's C++ side) and ``REGISTER_DEVICE_IMPL(...)``
statements. Items that name a launcher no kept ``.cu`` defines are dropped, then (to a fixed
point) items that name a dropped wrapper.
"""
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Set, Tuple

#: The ops (``{op}_cuda.cu`` kernels) the GPU check's detectors call on CUDA.
NEEDED_OPS: Tuple[str, ...] = ('focal_loss', 'nms', 'roi_align')
CUDA_DIR = Path('mmcv/ops/csrc/pytorch/cuda')
BINDINGS = 'cudabind.cpp'
REGISTER = 'REGISTER_DEVICE_IMPL('
_NAME = re.compile(r'(\w+)\s*\(')
_REGISTERED = re.compile(r'REGISTER_DEVICE_IMPL\(\s*(\w+)')


@dataclass
class PruneReport:
    kept_kernels: List[str]
    dropped_kernels: List[str]
    kept_impls: List[str]       # dispatch entries still registered for CUDA
    dropped_impls: List[str]


@dataclass
class Item:
    """One top-level item of a C++ file: its text, the name it declares or defines (the
    identifier before its first parenthesis), whether it has a body, the names it uses."""

    text: str
    name: str
    has_body: bool
    uses: Set[str]


def split_items(text: str) -> Tuple[str, List[Item]]:
    """``(preamble, items)``: the leading ``#`` lines, then the top-level statements and
    function definitions (a ``;`` or a closing brace back at depth 0 ends one; a ``;`` right
    after a body belongs to it; ``REGISTER_DEVICE_IMPL(...)`` ends at its parenthesis, since
    mmcv writes some without a ``;``)."""
    lines = text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and (lines[start].startswith('#') or not lines[start].strip()):
        start += 1
    preamble, body = ''.join(lines[:start]), ''.join(lines[start:])
    items, depth, begin, i = [], 0, 0, 0
    while i < len(body):
        ch = body[i]
        if ch == '/' and body.startswith('//', i):
            i = body.find('\n', i)
            i = len(body) if i < 0 else i
            continue
        if depth == 0 and body.startswith(REGISTER, i):  # a macro call, `;` optional
            end = body.index(')', i) + 1
            if body[end:].lstrip(' ').startswith(';'):
                end = body.index(';', end) + 1
            items.append(_item(body[begin:end]))
            begin, i = end, end
            continue
        depth += (ch == '{') - (ch == '}')
        if depth == 0 and ch in ';}':
            end = i + 1
            if ch == '}' and body[end:].lstrip(' ').startswith(';'):
                end = body.index(';', end) + 1
            items.append(_item(body[begin:end]))
            begin, i = end, end
            continue
        i += 1
    if body[begin:].strip():
        items.append(_item(body[begin:]))
    return preamble, items


def _item(text: str) -> Item:
    head = text.split('{', 1)[0]
    m = _NAME.search(head)
    return Item(text=text, name=m.group(1) if m else '', has_body='{' in text,
                uses=set(re.findall(r'\w+', text)))


def prune_bindings(text: str, kernel_sources: Sequence[str]) -> Tuple[str, List[str],
                                                                      List[str]]:
    """``cudabind.cpp`` without the items that need a launcher ``kernel_sources`` do not
    define; returns the new text and the impl names kept and dropped."""
    preamble, items = split_items(text)
    defined_here = {it.name for it in items if it.has_body}
    declared = {it.name for it in items if not it.has_body and it.name
                and not it.name.endswith('_impl') and it.name != 'REGISTER_DEVICE_IMPL'}
    kernels = '\n'.join(kernel_sources)
    missing = {n for n in declared - defined_here
               if not re.search(rf'\b{re.escape(n)}\s*\(', kernels)}
    kept = list(items)
    while True:
        drop = [it for it in kept if it.uses & missing]
        if not drop:
            break
        missing |= {it.name for it in drop if it.has_body}
        dropped = {id(it) for it in drop}
        kept = [it for it in kept if id(it) not in dropped]
    kept_impls = [n for it in kept for n in _REGISTERED.findall(it.text)]
    kept_ids = {id(it) for it in kept}
    dropped_impls = [n for it in items if id(it) not in kept_ids
                     for n in _REGISTERED.findall(it.text)]
    return preamble + ''.join(it.text for it in kept) + '\n', kept_impls, dropped_impls


def prune_tree(src: Path, ops: Sequence[str] = NEEDED_OPS) -> PruneReport:
    """Delete the ``.cu`` files of ops not in ``ops`` from the sdist at ``src`` and rewrite
    ``cudabind.cpp`` to match. A named op without a kernel file is an error."""
    cuda = Path(src) / CUDA_DIR
    if not (cuda / BINDINGS).is_file():
        raise FileNotFoundError(f'{cuda / BINDINGS} not found: is {src} an unpacked mmcv '
                                '2.1.0 sdist?')
    kernels: Dict[str, Path] = {p.name: p for p in sorted(cuda.glob('*.cu'))}
    wanted = [f'{op}_cuda.cu' for op in ops]
    missing = [w for w in wanted if w not in kernels]
    if missing:
        raise ValueError(f'no kernel {", ".join(missing)} in {cuda}; ops are named after '
                         f'its *_cuda.cu files (e.g. {", ".join(NEEDED_OPS)})')
    text, kept_impls, dropped_impls = prune_bindings(
        (cuda / BINDINGS).read_text(), [kernels[w].read_text() for w in wanted])
    dropped = [name for name in kernels if name not in wanted]
    for name in dropped:
        kernels[name].unlink()
    (cuda / BINDINGS).write_text(text)
    return PruneReport(kept_kernels=wanted, dropped_kernels=dropped, kept_impls=kept_impls,
                       dropped_impls=dropped_impls)
