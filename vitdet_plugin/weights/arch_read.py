"""Which architecture a state dict holds, read from its shapes: for the messages that refuse a
checkpoint of another size (a Swin-T checkpoint given to ``arch='base'``).

Reads our parameter names (a converted checkpoint, or a backbone's expected ``{name: shape}``):
``embed_dims`` from the patch embedding, ``depths`` and ``num_heads`` per Swin stage (V1: the
bias table's columns, V2: the logit scale's rows), ``depth`` of a plain ViT.
"""
import re
from typing import Dict, Mapping, Sequence, Tuple

#: The first norm of every Swin block: ``layers.{stage}.blocks.{block}.norm1.weight``.
_SWIN_BLOCK = re.compile(r'^layers\.(\d+)\.blocks\.(\d+)\.norm1\.weight$')
#: A Swin block's per-head tensor: V1's bias table ``(T, heads)``, V2's logit scale
#: ``(heads, 1, 1)``.
_SWIN_HEADS = re.compile(r'^layers\.(\d+)\.blocks\.0\.attn\.'
                         r'(relative_position_bias_table|logit_scale)$')
#: The first norm of every plain-ViT block.
_VIT_BLOCK = re.compile(r'^blocks\.(\d+)\.norm1\.weight$')
PATCH_KERNEL = 'patch_embed.proj.weight'

Arch = Dict[str, object]


def read_arch(shapes: Mapping[str, Sequence[int]]) -> Arch:
    """``embed_dims``, and ``depths`` / ``num_heads`` (Swin) or ``depth`` (ViT) of the state
    dict whose ``{name: shape}`` is ``shapes``; what cannot be read is left out."""
    arch: Arch = {}
    if PATCH_KERNEL in shapes:
        arch['embed_dims'] = int(shapes[PATCH_KERNEL][0])
    depths: Dict[int, int] = {}
    heads: Dict[int, int] = {}
    vit_depth = 0
    for name, shape in shapes.items():
        if m := _SWIN_BLOCK.match(name):
            depths[int(m[1])] = max(depths.get(int(m[1]), 0), int(m[2]) + 1)
        elif m := _SWIN_HEADS.match(name):
            heads[int(m[1])] = int(shape[1] if m[2] == 'relative_position_bias_table' else shape[0])
        elif m := _VIT_BLOCK.match(name):
            vit_depth = max(vit_depth, int(m[1]) + 1)
    if depths:
        arch['depths'] = tuple(depths[i] for i in sorted(depths))
        if sorted(heads) == sorted(depths):
            arch['num_heads'] = tuple(heads[i] for i in sorted(heads))
    if vit_depth:
        arch['depth'] = vit_depth
    return arch


def _text(arch: Arch) -> str:
    return ', '.join(f'{k}={v}' for k, v in arch.items())


def _preset(arch: Arch, presets: Mapping[str, Mapping[str, object]]) -> Tuple[str, ...]:
    """The presets that agree with every field of ``arch`` they name."""
    return tuple(name for name, preset in presets.items()
                 if any(k in preset for k in arch)
                 and all(_same(preset[k], v) for k, v in arch.items() if k in preset))


def _same(a: object, b: object) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


def arch_mismatch(checkpoint: Arch, model: Arch, source: str, owner: str,
                  presets: Mapping[str, Mapping[str, object]]) -> str:
    """The message for a checkpoint whose architecture differs from the model's, naming both
    and the preset (of ``presets``) that builds the checkpoint's; '' when they agree on every
    field both name."""
    if all(_same(v, model[k]) for k, v in checkpoint.items() if k in model):
        return ''
    names = _preset(checkpoint, presets)
    own = _preset(model, presets)
    fix = (f"build it with arch={names[0]!r}" if names else
           f'set its architecture arguments to {_text(checkpoint)}')
    return (f'the {source} holds {_text(checkpoint)}'
            + (f" (arch={names[0]!r})" if names else '')
            + f'; {owner} was built with {_text(model)}'
            + (f" (arch={own[0]!r})" if own else '') + f': {fix}')
