"""One checkpoint layout (:class:`Layout`): what each converter module declares in its own
``LAYOUTS`` tuple, and what :mod:`.layouts` gathers into the table.

A layout is detected by its module's classifier (``classify(sd)`` names the layout a state dict
is in, or None) and converted by its module's converter for a
:class:`~vitdet_plugin.functional.checkpoint_target.CheckpointTarget`. When a checkpoint fits
several layouts, the higher :attr:`Layout.priority` wins (:data:`CLASS_NAMED` over
:data:`SPECIFIC` over :data:`GENERIC`); a tie is refused (:func:`~.layouts.find_layout`).
"""
import dataclasses
from typing import Callable, List, Mapping, Optional, Tuple

from torch import Tensor

from ..functional.checkpoint_target import CheckpointTarget, StateDict

#: A layout whose keys name the model class (transformers' ``embeddings.patch_embeddings``):
#: it wins over the family layout its blocks also fit (a ``Swinv2Model`` has V2 attention).
CLASS_NAMED = 2
#: A layout whose keys prove its family (a marker in every block, a transformers class, Swin's
#: window attention): it wins over a :data:`GENERIC` one that fits the same checkpoint.
SPECIFIC = 1
#: A layout whose keys other families share (the plain ViT's ``blocks.{i}.attn.qkv``).
GENERIC = 0

#: ``(state dict, its layout, target, resampled) -> (converted, dropped keys)``; the converter
#: adds ``'<key> <shape> -> <shape>'`` to ``resampled`` (when given) for every tensor it resizes.
Convert = Callable[[StateDict, 'Layout', CheckpointTarget, Optional[List[str]]],
                   Tuple[StateDict, List[str]]]


#: Family names read with "an" (a vowel sound: "an EVA-02", "an RF-DETR").
_AN = ('A', 'E', 'I', 'O', 'U', 'RF-')


@dataclasses.dataclass(frozen=True)
class Layout:
    """One checkpoint layout: its family, its name, its module's classifier and converter;
    ``backbone_family``: a detector layout's backbone family, whose backbone loads the
    checkpoint's backbone part (an RF-DETR checkpoint's DINOv2)."""
    family: str
    name: str
    classify: Callable[[Mapping[str, Tensor]], Optional[str]]
    converter: Convert
    priority: int = SPECIFIC
    backbone_family: Optional[str] = None

    def loads_into(self, family: str) -> bool:
        """Whether a module loading ``family`` checkpoints loads this layout (or its
        backbone part)."""
        return family in (self.family, self.backbone_family)

    def detects(self, sd: Mapping[str, Tensor]) -> bool:
        """Whether ``sd`` (an unwrapped state dict) is in this layout."""
        return self.classify(sd) == self.name

    def convert(self, sd: StateDict, target: CheckpointTarget,
                resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
        """``sd`` in our names and ``target``'s sizes, and the checkpoint keys dropped."""
        return self.converter(sd, self, target, resampled)

    def describe(self) -> str:
        """``'a Swin checkpoint (mmdet layout)'``."""
        article = 'an' if self.family.startswith(_AN) else 'a'
        return f'{article} {self.family} checkpoint ({self.name} layout)'


def layouts_of(family: str, names: Tuple[str, ...],
               classify: Callable[[Mapping[str, Tensor]], Optional[str]], converter: Convert,
               priority: int = SPECIFIC, backbone_family: Optional[str] = None
               ) -> Tuple[Layout, ...]:
    """One :class:`Layout` per name of ``family`` (a module's ``LAYOUTS``)."""
    return tuple(Layout(family, name, classify, converter, priority, backbone_family)
                 for name in names)
