"""Stage runners: a stage's forward with our CPU kernels instead of the plain path's.

A backbone asks for its runner once per forward (:func:`swin_runner`, :func:`swin_v2_runner`,
:func:`vit_block_runner`, from the :class:`~.dispatch.AccelPlan` of the input); None means the
plain path. A runner computes what the block's own ``forward`` computes (the same window flow,
:func:`~vitdet_plugin.functional.to_windows`), with these kernels where the plan says so:

* ``recompute_attention``: window attention whose backward recomputes the probabilities
  (:func:`~.recompute.recompute_attention`; a trainable bias, fused attention, no dropout);
* ``recompute_gelu``: an MLP whose backward recomputes its exact GELU
  (:func:`~.recompute.gelu_linear`; under ``torch.compile`` a checkpointed region instead);
* ``compiled``: :func:`padding_free_window_attention`, which projects only the image tokens;
* ``chunked_inference`` (Swin V1): :mod:`.swin_inference`.

The parity tests (``tests/test_accel.py``, ``tests/test_compile.py``) hold them to the plain
path.
"""
from functools import partial
from typing import Callable, NamedTuple, Optional, Tuple, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ...functional import attend, from_windows, to_windows, window_bias
from .dispatch import PLAIN, AccelPlan
from .protocols import (BlockFn, MlpParts, SwinBlockParts, SwinV2BlockParts, ViTBlockParts,
                        WindowAttentionParts, WindowStageParts)
from .recompute import gelu_linear, recompute_attention
from .swin_inference import chunked_stage, norm_to_nchw


class StageRunner(NamedTuple):
    """How a backbone forward runs a stage (and, when given, an output norm) instead of the
    plain ``stage(x)`` (and ``norm(out)`` permuted to NCHW)."""
    run_stage: Callable[[WindowStageParts, Tensor], Tuple[Tensor, Tensor]]
    norm_to_nchw: Optional[Callable[[nn.Module, Tensor], Tensor]] = None


def _attend_windows(attn: WindowAttentionParts, qkv: Tensor, mask: Optional[Tensor],
                    plan: AccelPlan) -> Tensor:
    """``attn.attend_windows(qkv, mask)``, through the recomputing kernel where it applies:
    ``(B * nW, N, 3C)`` -> ``(B * nW, N, C)``."""
    q, k, v, bias = attn.window_heads(qkv, mask)       # (B * nW or B, heads', N, d)
    if plan.recompute_attention and bias.requires_grad and attn.fused and attn.dropout_p == 0:
        out = recompute_attention(q, k, v, bias, mask, attn.scale)
    else:
        out = attend(q, k, v, window_bias(bias, mask), attn.dropout_p, attn.fused, attn.scale)
    return attn.merge_window_heads(out, qkv.shape[0])


def padding_free_window_attention(x: Tensor, attn: WindowAttentionParts,
                                  window_size: Tuple[int, int], shift_size: Tuple[int, int],
                                  mask_dtype: torch.dtype,
                                  plan: AccelPlan = PLAIN) -> Tensor:
    """``(B, H, W, C)`` -> ``(B, H, W, C)``: the window attention of ``attn`` over the map
    ``x``, ``proj`` included, projecting only the image tokens (the compiled form).

    The plain path zero-pads the map and projects every window token; a zero token projects to
    the ``qkv`` bias, so here ``qkv`` of the ``H x W`` tokens is padded with that bias
    (:func:`~vitdet_plugin.functional.to_windows` ``fill``) and only the ``H x W`` outputs go
    through ``proj``. Under ``torch.compile`` the pad / roll / partition of the ``3C``
    projections fuse into one kernel; in eager mode they would move three times the channels
    (measured: a 20% slower CPU training step), so only the compiled plan uses this.
    """
    qkv = attn.project_qkv(x)                                       # (B, H, W, 3C)
    windows, grid = to_windows(qkv, window_size, shift_size, fill=attn.padding_qkv())
    out = _attend_windows(attn, windows, grid.shift_mask(x.device, mask_dtype), plan)
    return attn.project_out(from_windows(out, grid))                # (B, H, W, C)


def _window_attention(attn: WindowAttentionParts, x: Tensor, window_size: Tuple[int, int],
                      shift_size: Tuple[int, int], plan: AccelPlan) -> Tensor:
    """The attention branch of a window block on the map ``x`` ``(B, H, W, C)``."""
    if plan.compiled:
        return padding_free_window_attention(x, attn, window_size, shift_size, x.dtype, plan)
    windows, grid = to_windows(x, window_size, shift_size)          # (B * nW, N, C)
    out = _attend_windows(attn, attn.project_qkv(windows), grid.shift_mask(x.device, x.dtype),
                          plan)                                     # (B * nW, N, C)
    return from_windows(attn.project_out(out), grid)                # (B, H, W, C)


def _act_fc2(mlp: MlpParts, h: Tensor) -> Tensor:
    return mlp.fc2(mlp.act(h))


def _mlp(mlp: MlpParts, x: Tensor, plan: AccelPlan) -> Tensor:
    """``mlp(x)``; with ``recompute_gelu`` (exact GELU, no dropout) the GELU is recomputed in
    backward instead of stored."""
    act = mlp.act
    exact_gelu = (isinstance(act, nn.GELU) and act.approximate == 'none'
                  and isinstance(mlp.drop, nn.Identity))
    if not (plan.recompute_gelu and exact_gelu):
        return mlp(x)
    h = mlp.fc1(x)                                                  # (..., hidden)
    if plan.compiled:
        # a checkpointed region: the compiler keeps h and recomputes the GELU inside its fused
        # GELU-backward kernel (its fusion beats the custom op's eager one)
        return checkpoint(_act_fc2, mlp, h, use_reentrant=False)
    return gelu_linear(h, mlp.fc2.weight, mlp.fc2.bias)


def _swin_block(block: nn.Module, x: Tensor, plan: AccelPlan) -> Tensor:
    """``SwinBlock.forward`` with the plan's kernels."""
    b = cast(SwinBlockParts, block)
    x = x + b.drop_path(_window_attention(b.attn, b.norm1(x), b.window_size, b.shift_size, plan))
    return x + b.drop_path(_mlp(b.mlp, b.norm2(x), plan))


def _swin_v2_block(block: nn.Module, x: Tensor, plan: AccelPlan) -> Tensor:
    """``SwinV2Block.forward`` with the plan's kernels."""
    b = cast(SwinV2BlockParts, block)
    shift = b.shift_for((x.shape[1], x.shape[2]))
    x = x + b.drop_path(b.norm1(_window_attention(b.attn, x, b.window_size, shift, plan)))
    x = x + b.drop_path(b.norm2(_mlp(b.mlp, x, plan)))
    return b.norm3(x) if b.norm3 is not None else x


def _blocks_runner(block_fn: BlockFn) -> StageRunner:
    """Run the stage's blocks with ``block_fn`` (checkpointing and merging as the stage)."""
    return StageRunner(lambda stage, x: stage(x, block_fn))


def _kernels_apply(plan: AccelPlan) -> bool:
    return plan.compiled or plan.recompute_attention or plan.recompute_gelu


def swin_runner(plan: AccelPlan, training: bool) -> Optional[StageRunner]:
    """Swin V1's runner for ``plan``: chunked in-place inference (eval, no autograd), or the
    blocks with the training / compiled kernels; None: the plain path."""
    if plan.chunked_inference and not training:
        return StageRunner(chunked_stage, norm_to_nchw)
    if _kernels_apply(plan):
        return _blocks_runner(partial(_swin_block, plan=plan))
    return None


def swin_v2_runner(plan: AccelPlan) -> Optional[StageRunner]:
    """Swin V2's runner for ``plan`` (its inference runs the plain path); None: plain."""
    if _kernels_apply(plan):
        return _blocks_runner(partial(_swin_v2_block, plan=plan))
    return None


def vit_block_runner(plan: AccelPlan) -> Optional[BlockFn]:
    """How a ViT forward runs a block under ``plan``: its MLP through the GELU recompute
    (``ViTBlock.forward`` otherwise: ``attention``, MLP, optional residual conv block); None:
    the plain path."""
    if not plan.recompute_gelu:
        return None
    return partial(_vit_block, plan=plan)


def _vit_block(block: nn.Module, x: Tensor, plan: AccelPlan) -> Tensor:
    b = cast(ViTBlockParts, block)
    x = x + b.drop_path(b.attention(b.norm1(x)))
    x = x + b.drop_path(_mlp(b.mlp, b.norm2(x), plan))
    return b.residual_conv(x)
