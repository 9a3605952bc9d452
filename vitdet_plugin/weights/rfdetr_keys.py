"""RF-DETR checkpoint keys of the projector -> :class:`RFDETRProjector` keys (pure functions).

RF-DETR stores the projector under ``backbone.0.projector.`` as ``stages_sampling.<level>.<tap>``
(the resampling), ``stages.<level>.0`` (C2f: ``cv1``, ``m.<n>.cv1`` / ``cv2``, ``cv2``; each a
``conv`` + ``bn`` pair, ``bn`` being its channel LayerNorm) and ``stages.<level>.1`` (the final
norm). One rule table, read by :func:`rfdetr_projector_key`; RF-DETR's layout of the table
(:mod:`.rfdetr`) converts the projector with it.
"""
import re
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from torch import Tensor

#: Prefix of the projector in an RF-DETR ``model`` state dict.
RFDETR_PROJECTOR_PREFIX = 'backbone.0.projector.'

#: ``(RF-DETR pattern, our replacement)``, tried in order on the key without the prefix.
PROJECTOR_RULES: Tuple[Tuple[str, str], ...] = (
    (r'^stages_sampling\.(\d+)\.(\d+)\.0\.conv\.', r'samplers.\1.\2.0.conv.'),
    (r'^stages_sampling\.(\d+)\.(\d+)\.0\.bn\.', r'samplers.\1.\2.0.norm.'),
    (r'^stages_sampling\.', r'samplers.'),
    (r'^stages\.(\d+)\.0\.cv1\.bn\.', r'fusions.\1.conv_in.norm.'),
    (r'^stages\.(\d+)\.0\.cv1\.conv\.', r'fusions.\1.conv_in.conv.'),
    (r'^stages\.(\d+)\.0\.cv2\.bn\.', r'fusions.\1.conv_out.norm.'),
    (r'^stages\.(\d+)\.0\.cv2\.conv\.', r'fusions.\1.conv_out.conv.'),
    (r'^stages\.(\d+)\.0\.m\.(\d+)\.cv1\.bn\.', r'fusions.\1.blocks.\2.0.norm.'),
    (r'^stages\.(\d+)\.0\.m\.(\d+)\.cv1\.conv\.', r'fusions.\1.blocks.\2.0.conv.'),
    (r'^stages\.(\d+)\.0\.m\.(\d+)\.cv2\.bn\.', r'fusions.\1.blocks.\2.1.norm.'),
    (r'^stages\.(\d+)\.0\.m\.(\d+)\.cv2\.conv\.', r'fusions.\1.blocks.\2.1.conv.'),
    (r'^stages\.(\d+)\.1\.', r'norms.\1.'),
)


#: A rule's replacement: a ``re.sub`` template or a function of the match.
Replacement = Union[str, Callable[['re.Match[str]'], str]]


def rename(key: str, rules: Sequence[Tuple[str, Replacement]]) -> Optional[str]:
    """``key`` renamed by the first of ``rules`` (``(pattern, replacement)``) that matches it,
    or None when none does."""
    for pattern, replacement in rules:
        new, count = re.subn(pattern, replacement, key, count=1)
        if count:
            return new
    return None


def rfdetr_projector_key(key: str) -> str:
    """Our :class:`RFDETRProjector` key of an RF-DETR projector key (without
    :data:`RFDETR_PROJECTOR_PREFIX`); raises ``KeyError`` for a key no rule knows."""
    new = rename(key, PROJECTOR_RULES)
    if new is not None:
        return new
    raise KeyError(f'{key!r} is not a key of an RF-DETR projector (stages_sampling.* / '
                   'stages.*); is this the projector part of an RF-DETR checkpoint?')


def rfdetr_projector_state_dict(state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The projector entries of an RF-DETR ``model`` state dict (``backbone.0.projector.*``),
    under our :class:`RFDETRProjector` keys."""
    return {rfdetr_projector_key(k[len(RFDETR_PROJECTOR_PREFIX):]): v for k, v in state.items()
            if k.startswith(RFDETR_PROJECTOR_PREFIX)}
