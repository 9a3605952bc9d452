"""What the accel runners read of the model classes, typed.

accel sits below the model layers in the import graph (``tests/test_import_graph.py``), so it
cannot import the blocks it runs; it declares here what it reads of them instead. The model
modules check that their classes conform (``if TYPE_CHECKING:`` assignments next to
``SwinBlock`` and ``SwinV2Block``), so mypy ties both sides together. Members are read-only
properties where a block stores a narrower type than declared (its own ``Mlp`` for
:class:`MlpParts`), as a protocol's plain attributes are invariant.
"""
from typing import Callable, Iterable, Optional, Protocol, Tuple

from torch import Tensor, nn

#: ``block_fn(block, x) -> x``: how a stage runs one of its blocks.
BlockFn = Callable[[nn.Module, Tensor], Tensor]


class MlpParts(Protocol):
    """``layers.Mlp``: ``fc1 -> act -> drop -> fc2 -> drop``."""

    fc1: nn.Linear
    act: nn.Module
    fc2: nn.Linear

    @property
    def drop(self) -> nn.Module: ...

    def __call__(self, x: Tensor) -> Tensor: ...


class WindowAttentionParts(Protocol):
    """``layers.window_attention.WindowedAttention`` (Swin V1 and V2 window attention)."""

    qkv: nn.Linear
    proj: nn.Linear
    dim: int
    num_heads: int
    scale: float
    fused: bool

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
    """``backbones.swin.WindowAttention`` (Swin V1): a learned relative-position bias table."""

    relative_position_bias_table: nn.Parameter

    @property
    def window_tokens(self) -> int: ...

    def relative_position_bias(self) -> Tensor: ...


class ResidualBlockParts(Protocol):
    """What every transformer block has: two norms, an MLP, stochastic depth."""

    norm1: nn.Module
    norm2: nn.Module

    @property
    def mlp(self) -> MlpParts: ...

    @property
    def drop_path(self) -> nn.Module: ...


class SwinBlockParts(ResidualBlockParts, Protocol):
    """``backbones.swin.SwinBlock``: pre-norm (shifted) window attention, then the MLP."""

    window_size: Tuple[int, int]
    shift_size: Tuple[int, int]

    @property
    def shifted(self) -> bool: ...

    @property
    def attn(self) -> BiasTableAttentionParts: ...


class SwinV2BlockParts(ResidualBlockParts, Protocol):
    """``backbones.swin_v2.SwinV2Block``: residual post-norm window attention, then the MLP
    (and every few blocks a final ``norm3``)."""

    window_size: Tuple[int, int]

    @property
    def attn(self) -> WindowAttentionParts: ...

    norm3: Optional[nn.Module]

    def shift_for(self, hw: Tuple[int, int]) -> Tuple[int, int]: ...


class ViTBlockParts(ResidualBlockParts, Protocol):
    """``backbones.vit.ViTBlock``: pre-norm window or global attention, MLP, residual conv."""

    def attention(self, x: Tensor) -> Tensor: ...

    def residual_conv(self, x: Tensor) -> Tensor: ...


class MergeParts(Protocol):
    """``layers.PatchMerging``: ``(B, H, W, C)`` -> ``(B, ceil(H/2), ceil(W/2), out_dim)``."""

    out_dim: int

    def __call__(self, x: Tensor) -> Tensor: ...


class WindowStageParts(Protocol):
    """``backbones.hierarchical.WindowStage``: blocks, then optional patch merging."""

    @property
    def blocks(self) -> Iterable[nn.Module]: ...

    @property
    def downsample(self) -> Optional[nn.Module]: ...

    def __call__(self, x: Tensor, block_fn: Optional[BlockFn] = None) -> Tuple[Tensor, Tensor]:
        ...
