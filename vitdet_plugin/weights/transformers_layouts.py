"""Hugging Face transformers checkpoints: detection, renaming to a reference layout, and the
check of a model folder's ``config.json`` against the backbone.

Pure ``state_dict -> state_dict`` functions. A transformers state dict is renamed to the
reference layout of its family, whose own converter then takes it to ours (the rows of
:data:`~.layouts.LAYOUTS`): ``Dinov2Model`` / ``Dinov2WithRegistersModel`` -> the official
DINOv2 names, ``DINOv3ViTModel`` -> the official DINOv3 names, ``SwinModel`` /
``Swinv2Model`` -> the official Microsoft names, ``ViTModel`` / ``ViTMAEModel`` -> timm's ViT
names. The names are those of transformers 5 (``models/*/modeling_*.py`` and
``conversion_mapping.py``), in both spellings it uses:

* on disk (what ``save_pretrained`` writes and the hub holds): ``encoder.layer.{i}.attention.
  attention.{query,key,value}``, ``attention.output.dense``, ``intermediate.dense``,
  ``output.dense`` (ViT, DINOv2), ``attention.self.*`` (Swin, Swin V2), ``mlp.weights_in`` /
  ``weights_out`` (DINOv2 SwiGLU), ``layer.{i}.attention.{q,k,v,o}_proj`` (DINOv3);
* in memory (``model.state_dict()`` of transformers 5): ``attention.{q,k,v,o}_proj``,
  ``mlp.fc1`` / ``fc2``, ``mlp.{gate,up,down}_proj``, ``layers.{i}`` (ViT), ``model.layer.{i}``
  (DINOv3), ``attention.relative_position_bias.relative_position_bias_table`` (Swin).

Task wrappers keep the model under one attribute (``dinov2.``, ``dinov2_with_registers.``,
``vit.``, ``swin.``, ``swinv2.``): the model part is found by its patch embedding, the rest
(``classifier``, ``pooler``, MAE's ``decoder``, the mask token) is dropped and reported.
``SwinBackbone``'s ``hidden_states_norms.stage{k}`` are our output norms ``norm{k - 1}``.
"""
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional.checkpoint_target import CheckpointTarget
from . import swin, swin_v2, vit, vit_families
from .arch_read import PATCH_KERNEL, read_arch
from .common import StateDict
from .layout import CLASS_NAMED, Layout, layouts_of

#: The transformers classes we load (layout name ``'transformers ' + class``) and the family
#: whose backbone loads each.
TRANSFORMERS_MODELS = {'Dinov2Model': 'DINOv2', 'Dinov2WithRegistersModel': 'DINOv2',
                       'DINOv3ViTModel': 'DINOv3', 'SwinModel': 'Swin', 'Swinv2Model': 'Swin V2',
                       'ViTModel': 'ViT', 'ViTMAEModel': 'ViT'}
#: ``config.json``'s ``model_type`` of each class.
MODEL_TYPES = {'dinov2': 'Dinov2Model', 'dinov2_with_registers': 'Dinov2WithRegistersModel',
               'dinov3_vit': 'DINOv3ViTModel', 'swin': 'SwinModel', 'swinv2': 'Swinv2Model',
               'vit': 'ViTModel', 'vit_mae': 'ViTMAEModel'}
PREFIX = 'transformers '

#: The patch embedding of every class (``projection`` but DINOv3's), under the model's
#: attribute in a task wrapper (``dinov2.``, ``vit.``, ...).
_PATCH = re.compile(r'^((?:\w+\.)?)embeddings\.patch_embeddings\.(?:projection\.)?weight$')
_DINOV3_BLOCK = re.compile(r'^(?:model\.)?layer\.\d+\.')
_VIT_BLOCK = re.compile(r'^(?:encoder\.layer|layers)\.\d+\.layernorm_before\.')

#: Block-internal names (both spellings) -> the reference layouts' names; first match wins.
_BLOCK_RENAMES = (
    (r'attention\.(?:attention|self)\.query\.|attention\.q_proj\.', 'attn.q.'),
    (r'attention\.(?:attention|self)\.key\.|attention\.k_proj\.', 'attn.k.'),
    (r'attention\.(?:attention|self)\.value\.|attention\.v_proj\.', 'attn.v.'),
    (r'attention\.output\.dense\.|attention\.o_proj\.', 'attn.proj.'),
    (r'attention\.(?:self|relative_position_bias)\.relative_position_bias_table$',
     'attn.relative_position_bias_table'),
    (r'attention\.self\.continuous_position_bias_mlp\.', 'attn.cpb_mlp.'),
    (r'attention\.self\.logit_scale$', 'attn.logit_scale'),
    (r'intermediate\.dense\.', 'mlp.fc1.'),
    (r'output\.dense\.', 'mlp.fc2.'),
    (r'layernorm_before\.', 'norm1.'),
    (r'layernorm_after\.', 'norm2.'),
    (r'layer_scale([12])\.lambda1$', r'ls\1.gamma'),
    (r'mlp\.weights_in\.', 'mlp.w12.'),     # DINOv2 SwiGLU, packed (gate rows first)
    (r'mlp\.weights_out\.', 'mlp.w3.'),
    (r'mlp\.gate_proj\.', 'mlp.w1.'),       # SwiGLU: silu(w1 x) * w2 x -> w3
    (r'mlp\.up_proj\.', 'mlp.w2.'),
    (r'mlp\.down_proj\.', 'mlp.w3.'),
)
#: Where each class keeps its blocks -> the reference layout's prefix.
_BLOCK_PREFIXES = (
    (re.compile(r'^encoder\.layers\.(\d+)\.blocks\.(\d+)\.'), r'layers.\1.blocks.\2.'),
    (re.compile(r'^encoder\.layers\.(\d+)\.downsample\.'), r'layers.\1.downsample.'),
    (re.compile(r'^(?:encoder\.layer|layers|model\.layer|layer)\.(\d+)\.'), r'blocks.\1.'),
)
#: Embeddings and final norms -> the reference layouts' names (Swin's position table is
#: ``absolute_pos_embed``, DINOv3's registers ``storage_tokens``: set per class below).
_TOP_RENAMES = {
    'embeddings.patch_embeddings.projection.': 'patch_embed.proj.',
    'embeddings.patch_embeddings.': 'patch_embed.proj.',
    'embeddings.norm.': 'patch_embed.norm.',
    'embeddings.cls_token': 'cls_token',
    'embeddings.position_embeddings': 'pos_embed',
    'embeddings.register_tokens': 'register_tokens',
    'layernorm.': 'norm.',
    'norm.': 'norm.',
}
#: The model's parts (under its prefix); the rest is the task wrapper's (``classifier``, MAE's
#: ``decoder``, ``SwinBackbone``'s unused ``swin.layernorm``).
_MODEL_PARTS = ('embeddings.', 'encoder.', 'layers.', 'layer.', 'model.layer.', 'layernorm.',
                'norm.')
_STAGE_NORM = re.compile(r'^hidden_states_norms\.stage(\d+)\.')


def model_prefix(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The prefix of the transformers model inside ``sd`` (``''`` for a bare model,
    ``'dinov2.'`` in ``Dinov2ForImageClassification``, ...), or None when ``sd`` is no
    transformers checkpoint."""
    return next((m.group(1) for m in map(_PATCH.match, sd) if m), None)


def transformers_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout name of a transformers state dict (``'transformers Dinov2Model'``, one per
    key of :data:`TRANSFORMERS_MODELS`), or None when it is none of them. A ``ViTMAEModel``
    is told from a ``ViTModel`` by MAE's decoder (``ViTMAEForPreTraining``, the hub files);
    the encoder alone has ViTModel's names and loads as that layout."""
    prefix = model_prefix(sd)
    if prefix is None:
        return None
    inner = [k[len(prefix):] for k in sd if k.startswith(prefix)]
    name: Optional[str] = None
    if any('continuous_position_bias_mlp' in k or k.endswith('.logit_scale') for k in inner):
        name = 'Swinv2Model'
    elif any(k.startswith('encoder.layers.') and '.blocks.' in k for k in inner):
        name = 'SwinModel'
    elif any(_DINOV3_BLOCK.match(k) for k in inner):
        name = 'DINOv3ViTModel'
    elif any(k.endswith('layer_scale1.lambda1') for k in inner):
        name = ('Dinov2WithRegistersModel' if 'embeddings.register_tokens' in inner
                else 'Dinov2Model')
    elif any(_VIT_BLOCK.match(k) for k in inner):
        name = 'ViTMAEModel' if any(k.startswith('decoder.decoder_') for k in sd) else 'ViTModel'
    return None if name is None else PREFIX + name


def _rename(key: str) -> str:
    for pattern, repl in _BLOCK_PREFIXES:
        m = pattern.match(key)
        if m:
            rest = key[m.end():]
            for part, new in _BLOCK_RENAMES:
                rest, n = re.subn(f'^(?:{part})', new, rest)
                if n:
                    break
            return m.expand(repl) + rest
    for old, new in _TOP_RENAMES.items():
        if key == old or (old.endswith('.') and key.startswith(old)):
            return new + key[len(old):]
    m = _STAGE_NORM.match(key)  # SwinBackbone's output norms (stage k = our stage k - 1)
    return f'norm{int(m.group(1)) - 1}.{key[m.end():]}' if m else key


def _fuse_qkv(sd: StateDict, separate_bias: bool) -> StateDict:
    """``attn.{q,k,v}.{weight,bias}`` -> ``attn.qkv.weight`` (rows q, k, v) and either one
    ``attn.qkv.bias`` (zeros for a projection without bias) or, with ``separate_bias`` (Swin
    V2), ``attn.q_bias`` / ``attn.v_bias``."""
    out: StateDict = {}
    for k, v in sd.items():
        m = re.match(r'^(.*\.attn\.)([qkv])\.(weight|bias)$', k)
        if m is None:
            out[k] = v
            continue
        base, part, kind = m.groups()
        if part != 'q' or kind != 'weight':
            continue
        weights = [sd[f'{base}{p}.weight'] for p in 'qkv']
        out[f'{base}qkv.weight'] = torch.cat(weights, dim=0)
        biases = {p: sd.get(f'{base}{p}.bias') for p in 'qkv'}
        if separate_bias:
            out.update({f'{base}{p}_bias': b for p, b in biases.items() if b is not None})
        elif any(b is not None for b in biases.values()):
            out[f'{base}qkv.bias'] = torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0])
                 for b, w in zip(biases.values(), weights)])
    return out


def transformers_to_reference(sd: Mapping[str, Tensor], name: str
                              ) -> Tuple[StateDict, List[str]]:
    """A transformers state dict of layout ``name`` (see :func:`transformers_layout`) ->
    its family's reference layout (module docstring), and the dropped keys (the task
    wrapper's heads, the pooler)."""
    model = name[len(PREFIX):]
    prefix = model_prefix(sd) or ''
    inner: StateDict = {}
    dropped: List[str] = []
    for k, v in sd.items():
        part = k[len(prefix):]
        if _STAGE_NORM.match(k):
            inner[k] = v
        elif (k.startswith(prefix) and part.startswith(_MODEL_PARTS)
              and part != 'embeddings.mask_token'):  # masked-image pretraining only
            inner[part] = v
        else:
            dropped.append(k)
    out: StateDict = {}
    gated = any('.mlp.gate_proj.' in k for k in inner)
    for k, v in inner.items():
        if model == 'DINOv3ViTModel' and not gated:  # GELU MLP: up / down are fc1 / fc2
            k = re.sub(r'\.mlp\.up_proj\.', '.mlp.fc1.', k)
            k = re.sub(r'\.mlp\.down_proj\.', '.mlp.fc2.', k)
        out[_rename(k)] = v
    if model == 'DINOv3ViTModel':
        regs = out.pop('register_tokens', None)
        if regs is not None and regs.shape[1]:
            out['storage_tokens'] = regs
        elif regs is not None:
            dropped.append(prefix + 'embeddings.register_tokens')
    if model in ('SwinModel', 'Swinv2Model') and 'pos_embed' in out:
        out['absolute_pos_embed'] = out.pop('pos_embed')
    return _fuse_qkv(out, separate_bias=model == 'Swinv2Model'), dropped


def _reference_layout(family: str) -> Layout:
    """The layout a transformers checkpoint of ``family`` is renamed to (module docstring)."""
    family_layouts, name = _REFERENCE[family]
    return next(layout for layout in family_layouts if layout.name == name)


#: Per family: the module's layouts and the name of the reference layout among them.
_REFERENCE = {'Swin': (swin.LAYOUTS, 'official'), 'Swin V2': (swin_v2.LAYOUTS, 'official'),
              'ViT': (vit.LAYOUTS, 'timm_vit'),
              'DINOv2': (vit_families.LAYOUTS, 'dinov2' + vit_families.OFFICIAL),
              'DINOv3': (vit_families.LAYOUTS, 'dinov3' + vit_families.OFFICIAL)}


def convert_transformers_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                                resampled: Optional[List[str]] = None
                                ) -> Tuple[StateDict, List[str]]:
    """The table's transformers converter: renamed to the family's reference layout
    (:func:`transformers_to_reference`), then that layout's converter."""
    renamed, dropped = transformers_to_reference(sd, layout.name)
    converted, more = _reference_layout(layout.family).convert(renamed, target, resampled)
    return converted, dropped + more


#: One layout per transformers class (``'transformers Dinov2Model'``, ...).
LAYOUTS = tuple(layout for model, family in TRANSFORMERS_MODELS.items()
                for layout in layouts_of(family, (PREFIX + model,), transformers_layout,
                                         convert_transformers_layout, CLASS_NAMED))


# ----------------------------------------------------------------------------- config.json
def config_arch(config: Mapping[str, Any]) -> Tuple[str, Dict[str, object]]:
    """The transformers class of a ``config.json`` (by its ``model_type``) and the
    architecture it describes in our argument names (``embed_dims``, ``depth(s)``,
    ``num_heads``, ``patch_size``, ``num_reg_tokens``, ``mlp``, ``window_size``, ...)."""
    model_type = str(config.get('model_type'))
    model = MODEL_TYPES.get(model_type, '')
    c = config
    if model in ('SwinModel', 'Swinv2Model'):
        arch: Dict[str, object] = dict(embed_dims=c['embed_dim'], depths=tuple(c['depths']),
                                       num_heads=tuple(c['num_heads']),
                                       patch_size=c['patch_size'],
                                       use_abs_pos_embed=bool(c.get('use_absolute_embeddings')))
        if model == 'SwinModel':
            arch['window_size'] = c['window_size']
        else:
            arch['pretrained_window_sizes'] = _v2_windows(c)
        return model, arch
    if not model:
        return model, {}
    arch = dict(embed_dims=c['hidden_size'], depth=c['num_hidden_layers'],
                num_heads=c['num_attention_heads'], patch_size=c['patch_size'])
    if model.startswith('Dinov2'):
        arch['num_reg_tokens'] = int(c.get('num_register_tokens') or 0)
        arch['mlp'] = 'swiglu_packed' if c.get('use_swiglu_ffn') else 'gelu'
    elif model == 'DINOv3ViTModel':
        arch['num_reg_tokens'] = c.get('num_register_tokens', 0)
        arch['mlp'] = 'swiglu' if c.get('use_gated_mlp') else 'gelu'
        arch['rope_temperature'] = float(c['rope_theta'])
    else:
        arch['qkv_bias'] = 'qkv' if c.get('qkv_bias', True) else 'none'
    return model, arch


def _v2_windows(c: Mapping[str, Any]) -> Tuple[Tuple[int, int], ...]:
    """Per stage, the window Swin V2 normalised its relative offsets by: the pretrained
    window where given (> 0), else its own (``Swinv2SelfAttention``)."""
    own = int(c['window_size'])
    given: Sequence[int] = c.get('pretrained_window_sizes') or ()
    depths: Sequence[int] = c['depths']
    return tuple((p, p) if p else (own, own)
                 for p in list(given)[:len(depths)] + [0] * (len(depths) - len(given)))


#: Settings the loader adapts instead of refusing: DINOv2 / DINOv3 patch kernels are
#: resampled to the model's patch (FlexiViT), Swin V1 bias tables resized to its window.
_ADAPTED = {'DINOv2': ('patch_size',), 'DINOv3': ('patch_size',), 'Swin': ('window_size',)}


def model_arch(target: CheckpointTarget) -> Dict[str, object]:
    """What ``target`` was built with, in :func:`config_arch`'s names: the plain ViTs' arch
    fields (:attr:`~.target.CheckpointTarget.arch_fields`), the Swin fields read from its
    shapes (:func:`~.arch_read.read_arch`), its patch size, window and rotary base."""
    shapes = target.expected or {}
    arch: Dict[str, object] = dict(target.arch_fields)
    arch.update(read_arch({k: tuple(v) for k, v in shapes.items()}))
    if PATCH_KERNEL in shapes:
        arch['patch_size'] = int(shapes[PATCH_KERNEL][-1])
    if target.family in ('Swin', 'Swin V2'):
        arch['use_abs_pos_embed'] = target.pos_grid is not None
        arch['pretrained_window_sizes'] = tuple(target.pretrained_windows)
    if target.window_size is not None:
        arch['window_size'] = target.window_size[0]
    if target.rope_temperature is not None:
        arch['rope_temperature'] = target.rope_temperature
    return arch


def _text(name: str, value: object) -> str:
    """``name=value`` as the argument that sets it."""
    if name == 'rope_temperature':
        return f'rope=dict(temperature={value:g})'
    if name == 'pretrained_window_sizes':
        return f'pretrained_window_sizes={[w[0] for w in value]}'  # type: ignore[attr-defined]
    return f'{name}={value!r}'


def config_mismatch(config: Mapping[str, Any], family: str, target: CheckpointTarget,
                    source: str) -> str:
    """The error for a transformers ``config.json`` that describes another architecture
    than ``target`` (``family``: the family of the folder's weights), naming both values
    and the preset / arguments that build the folder's model; '' when they agree."""
    model, found = config_arch(config)
    if not model or target.expected is None:
        return ''
    activation = _activation(model, config)
    if activation:
        return f'the {source} (config.json: {model}) has {activation}'
    have = model_arch(target)
    skip = _ADAPTED.get(family, ())
    diff = [k for k, v in found.items() if k in have and k not in skip and not _same(v, have[k])]
    if not diff:
        return ''
    presets = target.arch_presets
    preset = next((name for name, fields in presets.items()
                   if any(k in found for k in fields)
                   and all(_same(fields[k], found[k]) for k in fields if k in found)), None)
    fix = [_text(k, found[k]) for k in diff]
    if preset is not None and any(k in presets[preset] for k in diff):
        fix = [f'arch={preset!r}'] + [_text(k, found[k]) for k in diff
                                      if k not in presets[preset]]
    return (f"the {source} (config.json: {model}) has {', '.join(_text(k, found[k]) for k in diff)}"
            f"; {target.owner} was built with {', '.join(_text(k, have[k]) for k in diff)}: "
            f"build it with {', '.join(fix)}")


def _activation(model: str, config: Mapping[str, Any]) -> str:
    """What is wrong with the MLP activation of ``config`` ('' when ours computes it): our
    MLPs are exact GELU and SiLU-gated (SwiGLU); transformers' DINOv3 gates with its
    ``hidden_act``, its DINOv2 SwiGLU always with SiLU."""
    if model.startswith('Dinov2') and config.get('use_swiglu_ffn'):
        return ''
    gated = bool(config.get('use_gated_mlp'))
    want = 'silu' if gated else 'gelu'
    act = config.get('hidden_act', want)
    if act == want:
        return ''
    kind = 'gated MLP (SwiGLU)' if gated else 'MLP (exact GELU)'
    return (f'hidden_act={act!r}; our {kind} computes {want!r}, no argument changes that: '
            f'a model with hidden_act={act!r} cannot be loaded')


def config_window(config: Mapping[str, Any]) -> Optional[Tuple[int, int]]:
    """The window a transformers Swin V1 folder was trained with (its bias tables are resized
    from it to the model's), or None for another class."""
    if config.get('model_type') != 'swin':
        return None
    w = int(config['window_size'])
    return (w, w)


def _same(a: object, b: object) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b)
    return a == b
