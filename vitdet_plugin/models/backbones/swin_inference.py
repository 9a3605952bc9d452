"""Swin V1 inference on the CPU: one token buffer per stage, updated in place, in chunks.

The plain path (:class:`~vitdet_plugin.models.layers.swin_block.SwinBlock`) pads, shifts and
partitions the whole map for every block and keeps several full-size temporaries alive (normed
map, ``qkv``, attention output, MLP hidden layer). On the CPU those cost more than their
arithmetic (page faults of fresh multi-megabyte blocks, evicted caches), so here each stage runs
on one flat buffer ``(B * H * W, C)``: chunks of windows are gathered, normalised, attended and
scatter-added back (the residual), padding tokens never enter the ``qkv`` / ``proj`` GEMMs, and
the MLP runs over row chunks with ``fc2`` accumulated straight into the buffer. Same values as
the plain path (``tests/models/backbones/test_accel.py``). Measured against the plain path
(docs/speed.md): 0.69x the Swin-T forward time at 800x1216, 0.61x at 1024x1024, no gain at 224x224.

:class:`~vitdet_plugin.models.backbones.swin.SwinBackbone` runs it when
:func:`chunked_inference_applies` (CPU, no autograd, no autocast, no graph capture) and calls
:func:`chunked_stage` per stage; this module calls the blocks' own submodules (norms, ``qkv``,
``proj``, the bias table, the MLP's layers).
"""
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional.attention import attend
from ...functional.size_cache import SizeCache
from ...functional.window import padded_size, shifted_window_mask, to_windows
from ..layers.patch_merging import PatchMerging
from ..layers.mlp import exporting_graph
from ..layers.swin_block import SwinBlock, WindowAttention

#: Device types where the chunked inference was measured to help.
CHUNKED_DEVICES = ('cpu',)
#: Target size of the largest temporary of one chunk.
CHUNK_BYTES = 8 << 20


def chunked_inference_applies(x: Tensor) -> bool:
    """Whether a forward of ``x`` takes this module: on the CPU without autograd, autocast or a
    graph capture (``torch.compile`` fuses the plain path itself; exported graphs hold standard
    ops only)."""
    return (x.device.type in CHUNKED_DEVICES and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type)
            and not torch.compiler.is_compiling() and not exporting_graph())


def rows_per_chunk(widest: int, element_size: int = 4) -> int:
    """Rows per chunk so that a ``(rows, widest)`` temporary stays near :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // max(1, widest * element_size))


def chunk_slices(n: int, rows: int) -> List[slice]:
    """``range(n)`` in the fewest chunks of at most ``rows``, of (nearly) equal size: no small
    remainder chunk, whose GEMMs would run far below peak."""
    count = max(1, -(-n // max(1, rows)))
    bounds = [i * n // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def map_height_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, out: Tensor) -> Tensor:
    """Inference: ``out[:, i] = fn(x[:, i])`` for ``(B, H, ...)`` tensors, over chunks of ``H``
    whose temporaries stay near :data:`CHUNK_BYTES`. ``out`` may be any strided view, e.g. an
    NCHW result seen as NHWC, so ``fn``'s output is written straight into its final layout."""
    step = rows_per_chunk(x[:, :1].numel(), x.element_size())
    for part in chunk_slices(x.shape[1], step):
        out[:, part] = fn(x[:, part])
    return out


class WindowChunk(NamedTuple):
    """A run of windows processed together."""
    windows: slice            # the windows' range in plan order
    rows: Tensor              # (R,) token-buffer rows of the image tokens, in window order
    real: Optional[Tensor]    # (R,) their positions among the W * N window tokens; None: the
                              # windows hold no padding (R == W * N)


class WindowPlan(NamedTuple):
    """The windows of ``B`` images stored in one flat token buffer ``(B * H * W, C)`` (images
    one after another), in chunks of windows that share a kind: windows without padding
    before windows with padding, and windows that need their own attention mask (where a
    shifted window wraps around) after all the others, from plan position ``first_masked`` on.
    Padding tokens are never stored: a padded chunk lists only its image tokens and where they
    sit among its window tokens.

    ``order[i]``: the index (:func:`window_partition` order, within its image) of the ``i``-th
    window of the plan, e.g. to pick the rows of a per-window mask.
    """
    chunks: Tuple[WindowChunk, ...]
    order: Tensor             # (B * nW,) int64
    first_masked: int


def window_sources(hw: Tuple[int, int], window_size: Tuple[int, int],
                   shift_size: Tuple[int, int]) -> Tensor:
    """``(nW, N)``: the flat ``H * W`` position of every token of every window of
    :func:`~vitdet_plugin.functional.to_windows` (the plain path's window flow), ``-1`` for
    padding."""
    h, w = hw
    grid = torch.arange(h * w).view(1, h, w, 1) + 1                 # 0 marks padding
    windows, _ = to_windows(grid, window_size, shift_size)          # (nW, N, 1)
    return windows.squeeze(-1) - 1                                  # (nW, N)


def window_plan(sources: Tensor, batch: int, windows_per_chunk: int,
                masked: Optional[Tensor] = None) -> WindowPlan:
    """The :class:`WindowPlan` of ``batch`` images windowed as ``sources`` (see
    :func:`window_sources`), in chunks of at most ``windows_per_chunk`` windows; ``masked``:
    ``(nW,)`` bool, the windows (of one image) that need a mask of their own."""
    tokens = int((sources >= 0).sum())
    is_pad = sources < 0
    src = sources.clamp(min=0)
    padded = is_pad.any(1)
    masked = torch.zeros_like(padded) if masked is None else masked.bool()
    chunks: List[WindowChunk] = []
    order: List[Tensor] = []
    start = first_masked = 0
    for kind_masked in (False, True):
        if kind_masked:
            first_masked = start
        for kind_padded in (False, True):
            group = torch.nonzero((masked if kind_masked else ~masked)
                                  & (padded if kind_padded else ~padded)).view(-1)
            if not group.numel():
                continue
            wins = group.repeat(batch)                               # image-major
            image = torch.arange(batch).repeat_interleave(group.numel()).unsqueeze(1)
            rows = src[wins] + image * tokens                        # (B * G, N)
            for part in chunk_slices(wins.numel(), windows_per_chunk):
                chunk_rows, real = rows[part].reshape(-1), None
                if kind_padded:
                    real = torch.nonzero(~is_pad[wins[part]].reshape(-1)).view(-1)
                    chunk_rows = chunk_rows[real]
                chunks.append(WindowChunk(slice(start + part.start, start + part.stop),
                                          chunk_rows, real))
            order.append(wins)
            start += wins.numel()
    return WindowPlan(tuple(chunks), torch.cat(order), first_masked)


class StagePlans(NamedTuple):
    """A stage's windows (plain and shifted) for ``B`` images of one size, and the shift
    masks ``(M, N, N)`` of the shifted plan's masked windows, in plan order (None: no window
    needs one)."""
    plain: WindowPlan
    shifted: Optional[WindowPlan]
    shift_masks: Optional[Tensor]


_PLANS: SizeCache[StagePlans] = SizeCache()


def stage_plans(hw: Tuple[int, int], batch: int, window: Tuple[int, int],
                shift: Tuple[int, int], windows_per_chunk: int,
                dtype: torch.dtype) -> StagePlans:
    """:class:`StagePlans`, cached per size, batch, window, shift, chunk and dtype."""
    def build() -> StagePlans:
        plain = window_plan(window_sources(hw, window, (0, 0)), batch, windows_per_chunk)
        if not any(shift):
            return StagePlans(plain, None, None)
        mask = shifted_window_mask(padded_size(hw, window), window, shift, dtype=dtype)
        needs_mask = mask.flatten(1).ne(0).any(1)                    # (nW,)
        shifted = window_plan(window_sources(hw, window, shift), batch, windows_per_chunk,
                              needs_mask)
        masked_order = shifted.order[shifted.first_masked:]
        return StagePlans(plain, shifted, mask[masked_order] if masked_order.numel() else None)
    return _PLANS.get((tuple(hw), batch, tuple(window), tuple(shift), windows_per_chunk, dtype),
                      build)


def _attend_tokens(attn: WindowAttention, x: Tensor, real: Optional[Tensor], windows: int,
                   bias: Tensor) -> Tensor:
    """Window attention of the image tokens ``x`` ``(R, C)`` (normalised, window order) of
    ``windows`` windows; ``real``: their positions among the ``windows * N`` window tokens
    (None: no padding). A padding token is zero after the norm, so its ``qkv`` row is the
    ``qkv`` bias: it takes part as key and value without a GEMM row, and its output is never
    projected. Returns ``(R, C)``."""
    n, heads = attn.window_size[0] * attn.window_size[1], attn.num_heads
    c = heads * attn.head_dim
    qkv = attn.qkv(x)                                               # (R, 3C)
    if real is not None:
        full = qkv.new_empty(windows * n, 3 * c)
        if attn.qkv.bias is not None:
            full.copy_(attn.qkv.bias.expand_as(full))
        else:
            full.zero_()
        qkv = full.index_copy_(0, real, qkv)                         # (windows * N, 3C)
    qkv = qkv.view(windows, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)                                          # (windows, heads, N, d)
    out = attend(q, k, v, bias, fused=attn.fused, scale=attn.scale)
    out = out.transpose(1, 2).reshape(windows * n, c)                # (windows * N, C)
    if real is not None:
        out = out.index_select(0, real)                              # (R, C)
    return attn.proj(out)


def _act_(act: nn.Module, h: Tensor) -> Tensor:
    """``act(h)``, overwriting ``h`` where the activation has an in-place form."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu_(h, approximate=act.approximate)
    if isinstance(act, nn.ReLU):
        return F.relu_(h)
    if isinstance(act, nn.SiLU):
        return F.silu(h, inplace=True)
    return act(h)


def _block_(block: SwinBlock, tokens: Tensor, plan: WindowPlan,
            shift_masks: Optional[Tensor]) -> None:
    """Apply a Swin block to the flat token buffer ``tokens`` ``(B * H * W, C)`` in place."""
    attn = block.attn
    shared = attn.relative_position_bias()                          # (1, heads, N, N)
    # (M, heads, N, N): the masked windows' biases, in plan order
    masked = shared if shift_masks is None else shared + shift_masks.unsqueeze(1)
    first = plan.first_masked
    for chunk in plan.chunks:
        start, stop = chunk.windows.start, chunk.windows.stop
        bias = shared if start < first else masked[start - first:stop - first]
        x = block.norm1(tokens.index_select(0, chunk.rows))
        tokens.index_add_(0, chunk.rows, _attend_tokens(attn, x, chunk.real, stop - start, bias))
    mlp = block.mlp
    step = rows_per_chunk(mlp.fc1.out_features, tokens.element_size())
    for part in chunk_slices(tokens.shape[0], step):
        rows = tokens[part]
        hidden = _act_(mlp.act, mlp.fc1(block.norm2(rows)))
        rows.addmm_(hidden, mlp.fc2.weight.t())                      # fc2 into the residual
        if mlp.fc2.bias is not None:
            rows.add_(mlp.fc2.bias)


def _stage_(blocks: Sequence[SwinBlock], x: Tensor) -> Tensor:
    """A stage's blocks on ``x`` ``(B, H, W, C)``, overwritten in place and returned."""
    b, h, w, c = x.shape
    attn = blocks[0].attn
    shift = next((blk.shift_size for blk in blocks if any(blk.shift_size)), (0, 0))
    window_tokens = blocks[0].window_size[0] * blocks[0].window_size[1]
    step = rows_per_chunk(3 * c * window_tokens, x.element_size())
    plans = stage_plans((h, w), b, blocks[0].window_size, shift, step,
                        attn.relative_position_bias_table.dtype)
    tokens = x.view(-1, c)                                           # (B * H * W, C)
    for block in blocks:
        if any(block.shift_size) and plans.shifted is not None:
            _block_(block, tokens, plans.shifted, plans.shift_masks)
        else:
            _block_(block, tokens, plans.plain, None)
    return x


def norm_to_nchw(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm`` over channels of ``(B, H, W, C)``, written in row chunks straight into a
    contiguous ``(B, C, H, W)`` result."""
    b, h, w, c = x.shape
    out = x.new_empty(b, c, h, w)
    map_height_chunks(norm, x, out.permute(0, 2, 3, 1))
    return out


def _merge(merge: PatchMerging, x: Tensor) -> Tensor:
    """Patch merging of ``(B, H, W, C)`` over bands of output rows written into one result (no
    full-size ``4C`` temporaries); same values as ``merge(x)``."""
    b, h, w, c = x.shape
    out = x.new_empty(b, -(-h // 2), -(-w // 2), merge.out_dim)
    step = rows_per_chunk(b * w * 2 * c, x.element_size())
    for part in chunk_slices(out.shape[1], step):
        out[:, part] = merge(x[:, 2 * part.start:2 * part.stop])
    return out


@torch.no_grad()
def chunked_stage(blocks: Iterable[nn.Module], merge: Optional[nn.Module],
                  x: Tensor) -> Tuple[Tensor, Tensor]:
    """A Swin stage in inference (eval, no autograd) on ``x`` ``(B, H, W, C)``: (the stage
    output, the input of the next stage), as the stage's plain forward. ``x`` is overwritten:
    the backbone forward owns it (its embedding or the previous stage's merge output)."""
    blocks = list(blocks)
    swin_blocks = [blk for blk in blocks if isinstance(blk, SwinBlock)]
    if len(swin_blocks) != len(blocks) or not (merge is None or isinstance(merge, PatchMerging)):
        raise TypeError('chunked_stage runs Swin V1 stages (SwinBlock, PatchMerging) only')
    out = _stage_(swin_blocks, x.contiguous())
    return out, (_merge(merge, out) if merge is not None else out)
