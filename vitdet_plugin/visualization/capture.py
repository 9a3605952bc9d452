"""What the backbone computes, read from the model during a real forward.

Forward pre-hooks on the blocks and their attention modules record their inputs: the token map
a block receives, the windows its attention receives and the shift mask passed with them (the
very tensor the model uses). Attention probabilities are recomputed from those captured inputs
with the attention module's own parameters and functions (``qkv``, ``scale``, the relative
position bias, the captured mask); :func:`attention_output` closes the loop by turning them into
the module's output, which the tests compare with what the module returned.

Swin-style backbones (``SwinBackbone``, and any backbone built the same way) are read through
``backbone.layers[i].blocks[j]`` with ``window_size``, ``shift_size`` and ``attn``; ViT-style
ones through ``backbone.blocks[i]`` with ``window_size`` (None: global) and ``attn``. Those
modules are read by duck typing (typed ``Any``), so backbones built the same way work too.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import VisualizeError
from ..functional import decomposed_rel_pos_bias
from ..models.backbones.swin_block import WindowAttention
from ..models.backbones.swin_v2_block import LOGIT_SCALE_MAX, CosineWindowAttention
from ..models.backbones.vit import RelPosAttention
from ..models.backbones.vit_block import ViTAttention


# ----------------------------------------------------------------------------- structure
def window_stages(backbone: Any) -> Any:
    """The shifted-window stages (an ``nn.ModuleList``) of a Swin-style backbone, or a
    :class:`VisualizeError`."""
    layers: Any = getattr(backbone, 'layers', None)
    stages: List[Any] = list(layers) if isinstance(layers, nn.ModuleList) else []
    if stages and all(hasattr(s, 'blocks') and all(
            hasattr(b, 'shift_size') and hasattr(b, 'attn') for b in s.blocks) for s in stages):
        return layers
    raise VisualizeError(f'{type(backbone).__name__} has no shifted-window stages '
                         '(backbone.layers[i].blocks[j] with window_size, shift_size and attn); '
                         'windows and shift-mask need a Swin-style backbone')


def check_stage(backbone: Any, stage: int) -> Any:
    """Stage ``stage`` of a Swin-style backbone, or an error naming the valid range."""
    stages = window_stages(backbone)
    if not 0 <= stage < len(stages):
        raise VisualizeError(f'stage {stage} is out of range: {type(backbone).__name__} has '
                             f'{len(stages)} stages (0..{len(stages) - 1})')
    return stages[stage]


def stage_stride(backbone: Any, stage: int) -> int:
    """Output stride of Swin stage ``stage``, from the declared contract (``out_strides`` of
    ``out_indices``) and Swin's 2x patch merging between stages."""
    first_index, first_stride = backbone.out_indices[0], backbone.out_strides[0]
    return int(first_stride * 2 ** (stage - first_index))


def block_shift(block: Any, map_hw: Tuple[int, int]) -> Tuple[int, int]:
    """The shift a Swin-style block applies on an ``H x W`` map: ``shift_for(hw)`` where the
    block defines one (a shift that depends on the map), else its ``shift_size``."""
    shift = block.shift_for(map_hw) if hasattr(block, 'shift_for') else block.shift_size
    return int(shift[0]), int(shift[1])


@dataclass(frozen=True)
class BlockRef:
    """One attention block: its index in forward order, its stage (Swin) and its stride."""

    index: int
    module: Any
    stride: int
    stage: Optional[int] = None
    index_in_stage: Optional[int] = None

    @property
    def name(self) -> str:
        where = f' (stage {self.stage} block {self.index_in_stage})' if self.stage is not None \
            else ''
        return f'block {self.index}{where}'


def attention_blocks(backbone: Any) -> List[BlockRef]:
    """Every attention block of the backbone in forward order (Swin: stage by stage)."""
    layers = getattr(backbone, 'layers', None)
    if isinstance(layers, nn.ModuleList) and all(hasattr(s, 'blocks') for s in layers):
        refs: List[BlockRef] = []
        for i, stage in enumerate(window_stages(backbone)):
            for j, block in enumerate(stage.blocks):
                refs.append(BlockRef(len(refs), block, stage_stride(backbone, i), i, j))
        return refs
    blocks = getattr(backbone, 'blocks', None)
    if isinstance(blocks, nn.ModuleList) and all(hasattr(b, 'attn') for b in blocks):
        return [BlockRef(i, b, int(backbone.patch_size)) for i, b in enumerate(blocks)]
    raise VisualizeError(f'{type(backbone).__name__} has no attention blocks to read '
                         '(backbone.layers[i].blocks[j] or backbone.blocks[i] with attn)')


def check_block(backbone: Any, index: int) -> BlockRef:
    """Block ``index`` (forward order), or an error naming the valid range."""
    refs = attention_blocks(backbone)
    if not 0 <= index < len(refs):
        stages = sorted({r.stage for r in refs if r.stage is not None})
        detail = '; '.join(
            f'stage {s}: {min(r.index for r in refs if r.stage == s)}..'
            f'{max(r.index for r in refs if r.stage == s)}' for s in stages)
        raise VisualizeError(f'block {index} is out of range: {type(backbone).__name__} has '
                             f'{len(refs)} blocks (0..{len(refs) - 1}'
                             + (f'; {detail})' if detail else ')'))
    return refs[index]


# ----------------------------------------------------------------------------- hooks
@dataclass
class Call:
    """The positional and keyword arguments of one module call (tensors detached)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def arg(self, position: int, name: str) -> Any:
        """The argument passed as ``name=`` or at ``position`` (None when absent)."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[position] if position < len(self.args) else None


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


@contextmanager
def record_calls(modules: Mapping[str, nn.Module]) -> Iterator[Dict[str, Call]]:
    """Record the first call of each module (forward pre-hooks, removed on exit)."""
    calls: Dict[str, Call] = {}
    handles = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            if name not in calls:
                calls[name] = Call(tuple(_detached(a) for a in args),
                                   {k: _detached(v) for k, v in kwargs.items()})
        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(hook_for(name), with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def run_backbone(backbone: Any, inputs: Tensor,
                 watch: Mapping[str, nn.Module]) -> Tuple[Tuple[Tensor, ...], Dict[str, Call]]:
    """The backbone's outputs on ``inputs`` and the first call of every watched module."""
    with torch.no_grad(), record_calls(watch) as calls:
        outs = backbone(inputs)
    missing = sorted(set(watch) - set(calls))
    if missing:
        raise RuntimeError(f'the forward never called {missing}: the backbone took a path '
                           'that bypasses these modules')
    if isinstance(outs, Tensor):
        outs = (outs,)
    return tuple(outs), calls


# ----------------------------------------------------------------------------- attention
def window_qkv(attn: Union[WindowAttention, CosineWindowAttention],
               windows: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` ``(nW, heads, N, d)`` of Swin V1 / V2 window attention on ``(nW, N, C)``
    windows, projected as the module does (V2: ``q_bias``, no key bias, ``v_bias``)."""
    if isinstance(attn, CosineWindowAttention) and attn.q_bias is not None:
        bias: Optional[Tensor] = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias),
                                            attn.v_bias])
    else:
        bias = attn.qkv.bias
    qkv = F.linear(windows, attn.qkv.weight, bias)                 # (nW, N, 3C)
    nw, n, _ = qkv.shape
    q, k, v = qkv.view(nw, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def swin_attention_probs(attn: WindowAttention, windows: Tensor,
                         mask: Optional[Tensor]) -> Tensor:
    """Attention probabilities ``(nW, heads, N, N)`` of Swin window attention.

    ``windows``: ``(nW, N, C)`` windows of one image as the module received them; ``mask``:
    the ``(nW, N, N)`` shift mask passed with them, or None. The formula of the module:
    ``softmax(q k^T * scale + relative_position_bias + mask)``.
    """
    q, k, _ = window_qkv(attn, windows)                          # (nW, heads, N, d)
    logits = (q * attn.scale) @ k.transpose(-2, -1) + attn.relative_position_bias()
    if mask is not None:
        logits = logits + mask.unsqueeze(1).to(logits.dtype)      # (nW, 1, N, N)
    return logits.softmax(dim=-1)


def vit_attention_probs(attn: ViTAttention, call: Call) -> Tensor:
    """Attention probabilities ``(B, heads, N, N)`` of plain-ViT attention over the captured
    tokens ``(B, N, C)`` of a ``grid`` (a window or the whole map): ``softmax(q k^T * scale +
    rel. bias)`` with rotary q / k and the decomposed relative-position bias of the eager
    formulation."""
    tokens, grid = call.arg(0, 'x'), call.arg(1, 'grid')
    num_prefix, rope = call.arg(2, 'num_prefix') or 0, call.arg(3, 'rope')
    if num_prefix:
        raise VisualizeError('attention maps of blocks with cls / register tokens are not '
                             "supported; build the backbone with prefix_tokens='drop'")
    q, k, _ = attn.qkv_heads(tokens)                              # (B, heads, N, d)
    if rope is not None:
        q, k = attn.rotate(q, 0, rope), attn.rotate(k, 0, rope)
    logits = (q * attn.scale) @ k.transpose(-2, -1)
    if isinstance(attn, RelPosAttention):
        logits = logits + decomposed_rel_pos_bias(q, attn.rel_pos_h, attn.rel_pos_w, grid, grid)
    return logits.softmax(dim=-1)


def cosine_window_attention_probs(attn: CosineWindowAttention, windows: Tensor,
                                  mask: Optional[Tensor]) -> Tensor:
    """Attention probabilities ``(nW, heads, N, N)`` of Swin V2 cosine window attention:
    ``softmax(cos(q, k) * exp(min(logit_scale, max)) + position_bias() + mask)``."""
    q, k, _ = window_qkv(attn, windows)                          # (nW, heads, N, d)
    scale = attn.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()    # (heads, 1, 1)
    logits = (F.normalize(q, dim=-1) * scale) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logits = logits + attn.position_bias()
    if mask is not None:
        logits = logits + mask.unsqueeze(1).to(logits.dtype)      # (nW, 1, N, N)
    return logits.softmax(dim=-1)


@torch.no_grad()
def attention_probs(attn: Any, call: Call) -> Tensor:
    """Probabilities ``(B', heads, N, N)`` of the captured call of ``attn`` (all windows)."""
    if isinstance(attn, WindowAttention):
        return swin_attention_probs(attn, call.arg(0, 'x'), call.arg(1, 'mask'))
    if isinstance(attn, ViTAttention):
        return vit_attention_probs(attn, call)
    if isinstance(attn, CosineWindowAttention):
        return cosine_window_attention_probs(attn, call.arg(0, 'x'), call.arg(1, 'mask'))
    raise VisualizeError(f'attention maps of {type(attn).__name__} are not supported (known: '
                         'WindowAttention, CosineWindowAttention, ViTAttention); add its formula '
                         'to vitdet_plugin/visualization/capture.py')


@torch.no_grad()
def attention_output(attn: Any, call: Call, probs: Tensor) -> Tensor:
    """The module's output from ``probs``: ``proj(probs @ v)``, shaped like its output."""
    x = call.arg(0, 'x')
    tokens = x.reshape(x.shape[0], -1, x.shape[-1])              # (B', N, C)
    if isinstance(attn, ViTAttention):
        v = attn.qkv_heads(tokens)[2]                            # (B', heads, N, d)
    else:
        v = window_qkv(attn, tokens)[2]
    out = (probs @ v).transpose(1, 2).reshape(tokens.shape)      # (B', N, C)
    if isinstance(attn, ViTAttention):
        out = attn.norm(out)                                     # EVA-02's sub-LN (or none)
    return attn.proj(out).reshape(x.shape)


def block_map_hw(call: Call) -> Tuple[int, int]:
    """The token map size of a captured block call: the ``(B, H, W, C)`` map a Swin block
    receives, or the grid of the plain ViT's token layout (its blocks take ``(B, N, C)``)."""
    layout = call.arg(1, 'layout')
    h, w = layout.grid if layout is not None else call.arg(0, 'x').shape[1:3]
    return int(h), int(w)
