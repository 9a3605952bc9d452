"""What the accel runners read of the model classes, typed.

accel sits below the model layers in the import graph (``tests/test_import_graph.py``), so it
cannot import the blocks it runs; it declares here what it reads of them instead. The model
modules check that their classes conform (``if TYPE_CHECKING:`` assignments next to
``SwinBlock`` and ``SwinV2Block``), so mypy ties both sides together. Members are read-only
properties: a block may store a narrower type (``nn.LayerNorm`` for ``nn.Module``).
"""
from typing import Callable, Iterable, Optional, Protocol, Tuple

from torch import Tensor, nn

#: ``block_fn(block, x) -> x``: how a stage runs one of its blocks.
BlockFn = Callable[[nn.Module, Tensor], Tensor]


class MlpParts(Protocol):
    """``layers.Mlp``: ``fc1 -> act -> drop -> fc2 -> drop``."""

    @property
    def fc1(self) -> nn.Linear: ...

    @property
    def act(self) -> nn.Module: ...

    @property
    def fc2(self) -> nn.Linear: ...

    @property
    def drop(self) -> nn.Module: ...

    def __call__(self, x: Tensor) -> Tensor: ...


class WindowAttentionParts(Protocol):
    """``layers.window_attention.WindowedAttention`` (Swin V1 and V2 window attention)."""

    @property
    def qkv(self) -> nn.Linear: ...

    @property
    def proj(self) -> nn.Linear: ...

    @property
    def dim(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def scale(self) -> float: ...

    @property
    def fused(self) -> bool: ...

    @property
    def dropout_p(self) -> float: ...

    def project_qkv(self, x: Tensor) -> Tensor: ...

    def padding_qkv(self) -> Optional[Tensor]: ...

    def window_heads(self, qkv: Tensor, mask: Optional[Tensor]
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor]: ...

    def merge_window_heads(self, out: Tensor, windows: int) -> Tensor: ...

    def attend_windows(self, qkv: Tensor, mask: Optional[Tensor] = None) -> Tensor: ...

    def project_out(self, x: Tensor) -> Tensor: ...


class BiasTableAttentionParts(WindowAttentionParts, Protocol):
    """``layers.WindowAttention`` (Swin V1): a learned relative-position bias table."""

    @property
    def relative_position_bias_table(self) -> nn.Parameter: ...

    @property
    def window_tokens(self) -> int: ...

    def relative_position_bias(self) -> Tensor: ...


class SwinBlockParts(Protocol):
    """``backbones.swin.SwinBlock``: pre-norm (shifted) window attention, then the MLP."""

    @property
    def window_size(self) -> Tuple[int, int]: ...

    @property
    def shift_size(self) -> Tuple[int, int]: ...

    @property
    def shifted(self) -> bool: ...

    @property
    def norm1(self) -> nn.Module: ...

    @property
    def attn(self) -> BiasTableAttentionParts: ...

    @property
    def drop_path(self) -> nn.Module: ...

    @property
    def norm2(self) -> nn.Module: ...

    @property
    def mlp(self) -> MlpParts: ...


class SwinV2BlockParts(Protocol):
    """``backbones.swin_v2.SwinV2Block``: residual post-norm window attention, then the MLP."""

    @property
    def window_size(self) -> Tuple[int, int]: ...

    @property
    def norm1(self) -> nn.Module: ...

    @property
    def attn(self) -> WindowAttentionParts: ...

    @property
    def drop_path(self) -> nn.Module: ...

    @property
    def norm2(self) -> nn.Module: ...

    @property
    def norm3(self) -> Optional[nn.Module]: ...

    @property
    def mlp(self) -> MlpParts: ...

    def shift_for(self, hw: Tuple[int, int]) -> Tuple[int, int]: ...


class ViTBlockParts(Protocol):
    """``backbones.vit.ViTBlock``: pre-norm window or global attention, MLP, residual conv."""

    @property
    def norm1(self) -> nn.Module: ...

    @property
    def drop_path(self) -> nn.Module: ...

    @property
    def norm2(self) -> nn.Module: ...

    @property
    def mlp(self) -> MlpParts: ...

    def attention(self, x: Tensor) -> Tensor: ...

    def residual_conv(self, x: Tensor) -> Tensor: ...


class MergeParts(Protocol):
    """``layers.PatchMerging``: ``(B, H, W, C)`` -> ``(B, ceil(H/2), ceil(W/2), out_dim)``."""

    @property
    def out_dim(self) -> int: ...

    def __call__(self, x: Tensor) -> Tensor: ...


class WindowStageParts(Protocol):
    """``backbones.hierarchical.WindowStage``: blocks, then optional patch merging."""

    @property
    def blocks(self) -> Iterable[nn.Module]: ...

    @property
    def downsample(self) -> Optional[nn.Module]: ...

    def __call__(self, x: Tensor, block_fn: Optional[BlockFn] = None) -> Tuple[Tensor, Tensor]:
        ...
