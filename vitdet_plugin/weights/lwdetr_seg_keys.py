"""RF-DETR-Seg checkpoint -> :class:`LWDETRSegHead`'s mask branch (``mask_branch.*``).

Pure functions over an RF-DETR ``model`` state dict: RF-DETR's ``segmentation_head.*`` keys
-> ours (one rule table, read with :func:`~.rfdetr_keys.rename`). A seg checkpoint's head is
the detection head's keys (:func:`~.lwdetr_keys.rfdetr_head_state_dict`) plus these:
:func:`split_mask_branch` separates the two; RF-DETR's layout of the table (:mod:`.rfdetr`)
converts a seg checkpoint with both.
"""
from typing import Dict, Mapping, Tuple

from torch import Tensor

from .rfdetr_keys import rename

#: RF-DETR's prefix of the mask branch.
SEG_PREFIX = 'segmentation_head.'
#: ``(RF-DETR pattern, our replacement)`` of the keys under :data:`SEG_PREFIX`, tried in order.
MASK_BRANCH_RULES: Tuple[Tuple[str, str], ...] = (
    (r'^blocks\.(\d+)\.(dwconv|norm)\.(weight|bias)$', r'blocks.\1.\2.\3'),
    (r'^blocks\.(\d+)\.pwconv1\.(weight|bias)$', r'blocks.\1.pwconv.\2'),
    (r'^spatial_features_proj\.(weight|bias)$', r'pixel_proj.\1'),
    (r'^query_features_block\.norm_in\.(weight|bias)$', r'query_mlp.norm.\1'),
    (r'^query_features_block\.layers\.0\.(weight|bias)$', r'query_mlp.mlp.fc1.\1'),
    (r'^query_features_block\.layers\.2\.(weight|bias)$', r'query_mlp.mlp.fc2.\1'),
    (r'^query_features_proj\.(weight|bias)$', r'query_proj.\1'),
    (r'^bias$', r'bias'),
)
#: Our prefix of the mask branch in :class:`LWDETRSegHead`.
OUR_PREFIX = 'mask_branch.'


def rfdetr_mask_branch_key(key: str) -> str:
    """Our key of an RF-DETR ``segmentation_head.*`` key; ``KeyError`` for one no rule
    knows (e.g. the layer-scale ``gamma`` RF-DETR-Seg never enables)."""
    new = rename(key[len(SEG_PREFIX):], MASK_BRANCH_RULES) if key.startswith(SEG_PREFIX) else None
    if new is not None:
        return OUR_PREFIX + new
    raise KeyError(f'{key!r} is not a key of RF-DETR-Seg\'s segmentation head '
                   f'({SEG_PREFIX}*); is this an RF-DETR-Seg checkpoint of this version?')


def split_mask_branch(state: Mapping[str, Tensor]
                      ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """An RF-DETR-Seg ``model`` state dict -> (every entry outside :data:`SEG_PREFIX`, as
    given; the mask branch under our keys)."""
    rest: Dict[str, Tensor] = {}
    branch: Dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith(SEG_PREFIX):
            branch[rfdetr_mask_branch_key(key)] = value
        else:
            rest[key] = value
    return rest, branch
