"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) and the ordinary mmengine file.

A DCP checkpoint is a directory: ``.metadata`` plus one ``__<rank>_0.distcp`` file per rank
that wrote it, holding an mmengine checkpoint (``meta``, ``state_dict``, ``optimizer``,
``message_hub``, ``param_schedulers``, ...) as every tensor under its dotted path
(``state_dict.backbone.blocks.0.attn.qkv.weight``; a sharded tensor as the shards its ranks
wrote, resharded on load at any world size) and the rest of the dict, its tensors replaced by
their paths, as one pickled entry (:data:`SKELETON_KEY`): DCP's own nesting would turn integer
keys (a DDP run's optimizer state) into strings and ``OrderedDict`` / ``Counter`` (message hub,
``MultiStepLR`` milestones) into plain dicts.
:func:`dcp_to_file` turns it into the single file that ``tools/test.py``, ``load_from`` and DDP
runs read (full tensors, one process); :func:`file_to_dcp` turns a single file into a DCP
directory (one shard file). Both write next to the target and rename when complete, so an
interrupted conversion leaves no half-written checkpoint under the target's name.
Command: ``python tools/dcp_convert.py SRC DST`` (the direction from SRC).
``FSDP2Runner`` writes and reads such directories with every rank at once (:func:`save_dcp`:
each rank its ``DTensor`` shards; :func:`load_dcp`: each rank its shards at any world size).
"""
import io
import os
import os.path as osp
import shutil
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..weights.checkpoint_io import load_trusted_or_weights_only

#: the file DCP writes last into a checkpoint directory: its presence marks a complete one
DCP_METADATA = '.metadata'
PARTIAL_SUFFIX = '.partial'
#: the entry holding the checkpoint's structure and non-tensor values
SKELETON_KEY = 'mmengine_checkpoint'
#: a tensor's place in the skeleton: (TENSOR_TAG, its key in the DCP checkpoint)
TENSOR_TAG = '__dcp_tensor__'


def split_tensors(node: Any, tensors: Dict[str, torch.Tensor], path: str = '') -> Any:
    """``node`` with every tensor replaced by ``(TENSOR_TAG, path)``; the tensors go into
    ``tensors`` under their dotted paths. Containers keep their types and keys."""
    if isinstance(node, torch.Tensor):
        if path in tensors:
            raise ValueError(f'two tensors of the checkpoint have the path {path!r} (keys that '
                             'differ only in type, e.g. 0 and "0"); rename one')
        tensors[path] = node
        return (TENSOR_TAG, path)
    prefix = f'{path}.' if path else ''
    if isinstance(node, dict):
        out = node.copy()  # OrderedDict, Counter, ... stay what they are
        for key, value in node.items():
            out[key] = split_tensors(value, tensors, f'{prefix}{key}')
        return out
    if type(node) in (list, tuple):
        return type(node)(split_tensors(v, tensors, f'{prefix}{i}') for i, v in enumerate(node))
    return node


def join_tensors(node: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`; a dict entry whose tensor is not in ``tensors``
    (not loaded: :func:`load_dcp`'s shape mismatches) is left out."""
    if _is_placeholder(node):
        return tensors[node[1]]
    if isinstance(node, dict):
        out = node.copy()
        for key, value in node.items():
            if _is_placeholder(value) and value[1] not in tensors:
                del out[key]
            else:
                out[key] = join_tensors(value, tensors)
        return out
    if type(node) in (list, tuple):
        return type(node)(join_tensors(v, tensors) for v in node)
    return node


def _is_placeholder(node: Any) -> bool:
    return type(node) is tuple and len(node) == 2 and node[0] == TENSOR_TAG


def read_dcp(src_dir: str) -> Dict[str, Any]:
    """The whole checkpoint of the DCP directory ``src_dir`` in this process (full tensors)."""
    return load_dcp(src_dir, {})[0]


def load_dcp(src_dir: str, templates: Dict[str, torch.Tensor], skip: Tuple[str, ...] = ()
             ) -> Tuple[Dict[str, Any], List[str]]:
    """The checkpoint of the DCP directory ``src_dir`` and the paths it left out.

    Every rank of the job calls it (a collective when a process group exists). A tensor whose
    path is in ``templates`` is read into the template itself, in place (no second copy; a
    ``DTensor`` template: this rank's shard only, DCP reshards from whatever world size wrote
    it; a template of another dtype: into a new tensor like it); one of another shape is left
    out (its path returned); every other tensor is read whole. The
    top-level entries named in ``skip`` are not read at all.
    """
    metadata = FileSystemReader(src_dir).read_metadata().state_dict_metadata
    if SKELETON_KEY not in metadata:
        raise ValueError(f'{src_dir} is a DCP checkpoint without the {SKELETON_KEY!r} entry of '
                         'an mmengine checkpoint; it was not written by vitdet_plugin')
    state: Dict[str, Any] = {}
    mismatched: List[str] = []
    for key, meta in metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or key.split('.', 1)[0] in skip:
            continue
        template = templates.get(key)
        if template is None:
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        elif tuple(template.shape) != tuple(meta.size):
            mismatched.append(key)
        elif template.dtype == meta.properties.dtype:
            state[key] = template
        else:
            state[key] = torch.empty_like(template, dtype=meta.properties.dtype)
    state[SKELETON_KEY] = io.BytesIO()
    dcp.load(state, checkpoint_id=src_dir)
    pickled = state.pop(SKELETON_KEY)  # DCP wrote the entry's bytes into it
    pickled.seek(0)  # weights_only, as every checkpoint read (the trust list names src_dir)
    checkpoint = join_tensors(load_trusted_or_weights_only(pickled, given=src_dir), state)
    for key in skip:
        checkpoint.pop(key, None)
    return checkpoint, mismatched


def save_dcp(checkpoint: Dict[str, Any], dst_dir: str) -> None:
    """Write ``checkpoint`` (an mmengine checkpoint dict) as the DCP directory ``dst_dir``.

    Every rank of the job calls it with its own dict: the same tensor paths, ``DTensor`` s
    holding this rank's shards (each rank writes its own file, nothing is gathered); plain
    tensors and the non-tensor rest are rank 0's (as in the single file). Written as
    ``dst_dir.partial`` and renamed by rank 0 once DCP's metadata (written last, after every
    rank's data) is there: ``dst_dir`` is complete or absent, never half-written; an existing
    ``dst_dir`` is replaced.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    partial = dst_dir + PARTIAL_SUFFIX
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
    if distributed:
        dist.barrier()
    tensors: Dict[str, torch.Tensor] = {}
    skeleton = split_tensors(checkpoint, tensors)
    # DTensors: every rank its shards; plain tensors (buffers, AdamW steps, RNG states): rank 0's
    state: Dict[str, Any] = {k: v for k, v in tensors.items()
                             if rank0 or isinstance(v, DTensor)}
    if rank0:  # one entry, rank 0's (DCP would flatten a dict; the ranks' loss logs differ)
        pickled = io.BytesIO()
        torch.save(skeleton, pickled)
        state[SKELETON_KEY] = pickled
    dcp.save(state, checkpoint_id=partial)  # returns on every rank after the metadata
    if rank0:
        if osp.isdir(dst_dir):
            shutil.rmtree(dst_dir)
        os.rename(partial, dst_dir)
    if distributed:
        dist.barrier()  # no rank goes on (loads, removes) before the rename


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete DCP checkpoint directory."""
    return osp.isdir(path) and osp.isfile(osp.join(path, DCP_METADATA))


def _check_target(dst: str) -> None:
    if osp.exists(dst):
        raise FileExistsError(f'{dst} exists; give a new path or remove it first')


def dcp_to_file(src_dir: str, dst_file: str) -> None:
    """Write the DCP checkpoint ``src_dir`` as one mmengine checkpoint file ``dst_file``
    (full tensors: the whole model and optimizer state in this process's memory)."""
    if not is_dcp_checkpoint(src_dir):
        raise ValueError(f'{src_dir} is not a DCP checkpoint directory (no {DCP_METADATA} in '
                         'it); give the directory a sharded run saved, e.g. work_dir/iter_N')
    _check_target(dst_file)
    partial = dst_file + PARTIAL_SUFFIX
    torch.save(read_dcp(src_dir), partial)
    os.replace(partial, dst_file)


def file_to_dcp(src_file: str, dst_dir: str) -> None:
    """Write the mmengine checkpoint file ``src_file`` as the DCP directory ``dst_dir``."""
    if not osp.isfile(src_file):
        raise ValueError(f'{src_file} is not a checkpoint file; give a .pth file '
                         '(a DCP directory converts the other way)')
    _check_target(dst_dir)
    save_dcp(load_trusted_or_weights_only(src_file, 'cpu'), dst_dir)


def convert(src: str, dst: str) -> str:
    """DCP directory -> file, or file -> DCP directory, by what ``src`` is; the direction."""
    if osp.isdir(src):
        dcp_to_file(src, dst)
        return 'DCP -> file'
    file_to_dcp(src, dst)
    return 'file -> DCP'
