"""Reading a Hugging Face transformers model folder (what ``save_pretrained`` writes): its
``config.json`` and its weights, one file or shards, through the safe readers of
:mod:`.checkpoint_io`. Its layouts (the renames) are :mod:`.transformers_layouts`.
"""
import json
import os
from typing import Any, Callable, Optional, Union

from .checkpoint_io import URL, CheckpointError, load_safetensors, load_trusted_or_weights_only

#: A transformers model folder's files (``save_pretrained``): the config, one weights file or
#: an index of shards, in the order they are looked for (safetensors first).
TRANSFORMERS_CONFIG = 'config.json'
TRANSFORMERS_WEIGHTS = (('model.safetensors', 'model.safetensors.index.json'),
                        ('pytorch_model.bin', 'pytorch_model.bin.index.json'))


def is_transformers_folder(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a local directory (read as a transformers model folder)."""
    return not URL.match(os.fspath(path)) and os.path.isdir(os.path.expanduser(path))


def read_transformers_config(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The ``config.json`` of a transformers model folder; None when ``path`` is no folder.
    A folder without one is refused (it is no ``save_pretrained`` folder)."""
    if not is_transformers_folder(path):
        return None
    folder = os.path.expanduser(os.fspath(path))
    config = os.path.join(folder, TRANSFORMERS_CONFIG)
    if not os.path.isfile(config):
        raise CheckpointError(
            f'{folder!r} is a directory without {TRANSFORMERS_CONFIG}: a checkpoint directory '
            f'must be a Hugging Face transformers model folder (save_pretrained writes '
            f'{TRANSFORMERS_CONFIG} and model.safetensors); give that folder or a checkpoint '
            'file')
    with open(config) as f:
        return json.load(f)


def load_transformers_folder(path: Union[str, os.PathLike], map_location: str = 'cpu') -> dict:
    """The tensors of a transformers model folder: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (``model-0000k-of-0000n.safetensors``); else
    ``pytorch_model.bin`` (``weights_only``) or its shards. A shard the index names but the
    folder lacks, or a tensor the index names but no shard holds, is refused naming it."""
    read_transformers_config(path)
    folder = os.path.expanduser(os.fspath(path))
    for single, index in TRANSFORMERS_WEIGHTS:
        reader: Callable[[str, str], Any] = (load_safetensors if single.endswith('.safetensors')
                                             else load_trusted_or_weights_only)
        if os.path.isfile(os.path.join(folder, single)):
            return reader(os.path.join(folder, single), map_location)
        if not os.path.isfile(os.path.join(folder, index)):
            continue
        with open(os.path.join(folder, index)) as f:
            weight_map: dict = json.load(f)['weight_map']
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise CheckpointError(
                f'the sharded checkpoint {folder!r} lacks {", ".join(missing)} (of the '
                f'{len(shards)} shards its {index} lists): download or copy the missing '
                'shard into the folder')
        sd: dict = {}
        for shard in shards:
            sd.update(reader(os.path.join(folder, shard), map_location))
        absent = [k for k in weight_map if k not in sd]
        if absent:
            raise CheckpointError(
                f'the sharded checkpoint {folder!r}: {index} places {absent[0]!r} in '
                f'{weight_map[absent[0]]!r}, which does not hold it; the shard is from '
                'another save: download the folder again')
        return sd
    names = ', '.join(n for pair in TRANSFORMERS_WEIGHTS for n in pair)
    raise CheckpointError(f'the transformers folder {folder!r} has no weights: expected one '
                          f'of {names}')
