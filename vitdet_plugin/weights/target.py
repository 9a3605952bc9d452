"""What a backbone tells the checkpoint loader about itself: :class:`CheckpointTarget`.

A backbone builds one with a small method (``checkpoint_target()``) and hands it to
:func:`~.layouts.load_checkpoint`; the loader never sees the module. Everything a converter
needs beyond the expected ``{name: shape}`` is a field here.
"""
import dataclasses
from typing import Mapping, Optional, Tuple

import torch

Pair = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class CheckpointTarget:
    """The module a checkpoint is converted for.

    Attributes:
        family: the checkpoint family it loads (a key of :data:`~.layouts.FAMILY_BACKBONES`:
            ``'Swin'``, ``'Swin V2'``, ``'ViT'``, ``'DINOv2'``, ``'DINOv3'``, ``'EVA-02'``,
            ``'simple FPN'``).
        owner: its type name, for messages (``'SwinBackbone'``).
        expected: ``{name: shape}`` of its state dict; None converts without a module (names
            only, ``tools/convert_weights.py``).
        window_size: Swin V1: the attention window (bias tables are resized to it).
        src_window_size: Swin V1: the checkpoint's window when it is rectangular (a load
            option of ``init_cfg``, not the module's).
        pos_grid: the stored absolute-position grid (position embeddings are resized to it).
        out_indices: Swin: the stages returned (output norms of the others are skipped).
        pretrained_windows: Swin V2: per stage, the window relative offsets are normalised by.
        patch_size: the patch kernel size (a family kernel of another size is resampled).
        rope_temperature, rope_ref_grid: DINOv3 / EVA-02: the rotary settings.
        in_stride: simple FPN: the stride of its input.
        arch_presets: the backbone's arch presets (``{name: fields}``), to name the one that
            builds a checkpoint of another size.
        arch_fields: the plain ViTs' resolved arch (``embed_dims``, ``num_heads``, ``mlp``,
            ``num_reg_tokens``, ...), checked against a transformers folder's config.json.
    """
    family: str
    owner: str
    expected: Optional[Mapping[str, torch.Size]] = None
    window_size: Optional[Pair] = None
    src_window_size: Optional[Pair] = None
    pos_grid: Optional[Pair] = None
    out_indices: Optional[Tuple[int, ...]] = None
    pretrained_windows: Tuple[Pair, ...] = ()
    patch_size: Optional[Pair] = None
    rope_temperature: Optional[float] = None
    rope_ref_grid: Optional[Pair] = None
    in_stride: int = 16
    arch_presets: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    arch_fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
