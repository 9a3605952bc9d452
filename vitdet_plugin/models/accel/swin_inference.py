"""Swin inference on the CPU: one token buffer per stage, updated in place, in chunks.

The plain path (``backbones/swin.py``) pads, shifts and partitions the whole map for every
block and keeps several full-size temporaries alive (normed map, ``qkv``, attention output,
MLP hidden layer). On the CPU those cost more than their arithmetic (page faults of fresh
multi-megabyte blocks, evicted caches), so here each stage runs on one flat buffer
``(B * H * W, C)``: chunks of windows are gathered, normalised, attended and scatter-added
back (the residual), padding tokens never enter the ``qkv`` / ``proj`` GEMMs, and the MLP runs
over row chunks with ``fc2`` accumulated straight into the buffer. Same values as the plain
path (``tests/test_accel.py``); used only where :mod:`.dispatch` says so.

:func:`chunked_stage` is a stage runner (:mod:`.runners`): it reads the stage's blocks
through the typed :mod:`.protocols`, as accel sits below the model layers in the import graph.
"""
from typing import List, NamedTuple, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional import SizeCache, attend, padded_size, shifted_window_mask
from .chunking import chunk_slices, map_height_chunks, rows_per_chunk
from .protocols import BiasTableAttentionParts, MergeParts, SwinBlockParts, WindowStageParts
from .torch_private import gelu_
from .window_plan import WindowPlan, window_plan, window_sources


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


def _attend_tokens(attn: BiasTableAttentionParts, x: Tensor, real: Optional[Tensor], windows: int,
                   bias: Tensor) -> Tensor:
    """Window attention of the image tokens ``x`` ``(R, C)`` (normalised, window order) of
    ``windows`` windows; ``real``: their positions among the ``windows * N`` window tokens
    (None: no padding). A padding token is zero after the norm, so its ``qkv`` row is the
    ``qkv`` bias: it takes part as key and value without a GEMM row, and its output is never
    projected. Returns ``(R, C)``."""
    n, c, heads = attn.window_tokens, attn.dim, attn.num_heads
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
        return gelu_(h, act.approximate)
    if isinstance(act, nn.ReLU):
        return F.relu_(h)
    if isinstance(act, nn.SiLU):
        return F.silu(h, inplace=True)
    return act(h)


def _block_(block: SwinBlockParts, tokens: Tensor, plan: WindowPlan,
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


def _stage_(stage: WindowStageParts, x: Tensor) -> Tensor:
    """A stage's blocks on ``x`` ``(B, H, W, C)``, overwritten in place and returned."""
    b, h, w, c = x.shape
    blocks: List[SwinBlockParts] = [cast(SwinBlockParts, blk) for blk in stage.blocks]
    attn = blocks[0].attn
    shift = next((blk.shift_size for blk in blocks if blk.shifted), (0, 0))
    step = rows_per_chunk(3 * c * attn.window_tokens, x.element_size())
    plans = stage_plans((h, w), b, blocks[0].window_size, shift, step,
                        attn.relative_position_bias_table.dtype)
    tokens = x.view(-1, c)                                           # (B * H * W, C)
    for block in blocks:
        if block.shifted and plans.shifted is not None:
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


def _merge(merge: MergeParts, x: Tensor) -> Tensor:
    """Patch merging of ``(B, H, W, C)`` over bands of output rows written into one result (no
    full-size ``4C`` temporaries); same values as ``merge(x)``."""
    b, h, w, c = x.shape
    out = x.new_empty(b, -(-h // 2), -(-w // 2), merge.out_dim)
    step = rows_per_chunk(b * w * 2 * c, x.element_size())
    for part in chunk_slices(out.shape[1], step):
        out[:, part] = merge(x[:, 2 * part.start:2 * part.stop])
    return out


@torch.no_grad()
def chunked_stage(stage: WindowStageParts, x: Tensor) -> Tuple[Tensor, Tensor]:
    """A Swin stage in inference (eval, no autograd) on ``x`` ``(B, H, W, C)``: (the stage
    output, the input of the next stage), as ``stage(x)``. ``x`` is overwritten: the backbone
    forward owns it (its embedding or the previous stage's merge output)."""
    out = _stage_(stage, x.contiguous())
    merge = stage.downsample
    return out, (_merge(cast(MergeParts, merge), out) if merge is not None else out)
