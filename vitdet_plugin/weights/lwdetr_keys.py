"""RF-DETR checkpoint -> :class:`LWDETRHead` (and :class:`RFDETRProjector`) state dicts.

Pure functions over an RF-DETR ``model`` state dict (``LWDETR``'s keys): :data:`HEAD_RULES`
rename the head's keys; the decoder's packed self-attention projection
(``nn.MultiheadAttention.in_proj_*``, ``(3C, ...)``) is split into our ``q_proj`` / ``k_proj``
/ ``v_proj``. The projector's keys are :mod:`.rfdetr_keys`'s. RF-DETR's layout of the table
(:mod:`.rfdetr`) converts the head with :func:`rfdetr_head_state_dict`.
"""
import re
from typing import Dict, Mapping, Tuple

from torch import Tensor

from .rfdetr_keys import Replacement, rename

#: ``(RF-DETR pattern, our replacement)``, tried in order (:func:`rename`);
#: ``self_attn.in_proj_*`` is split separately (:func:`rfdetr_head_state_dict`).
HEAD_RULES: Tuple[Tuple[str, Replacement], ...] = (
    (r'^transformer\.decoder\.layers\.(\d+)\.linear1\.', r'decoder.layers.\1.ffn.fc1.'),
    (r'^transformer\.decoder\.layers\.(\d+)\.linear2\.', r'decoder.layers.\1.ffn.fc2.'),
    (r'^transformer\.decoder\.layers\.(\d+)\.'
     r'(norm[123]|self_attn\.out_proj|cross_attn\.\w+)\.', r'decoder.layers.\1.\2.'),
    (r'^transformer\.decoder\.norm\.', r'decoder.norm.'),
    (r'^transformer\.decoder\.ref_point_head\.layers\.0\.', r'decoder.ref_point_head.fc1.'),
    (r'^transformer\.decoder\.ref_point_head\.layers\.1\.', r'decoder.ref_point_head.fc2.'),
    (r'^transformer\.(enc_output|enc_output_norm)\.(\d+)\.', r'\1.\2.'),
    (r'^transformer\.enc_out_class_embed\.(\d+)\.', r'enc_cls_branches.\1.'),
    (r'^class_embed\.', r'cls_branch.'),
    (r'^(query_feat|refpoint_embed)\.weight$', r'\1.weight'),
)
#: The box MLPs: RF-DETR's ``layers.<j>`` are our ``nn.Sequential`` entries ``2 j`` (ReLUs
#: between them).
BOX_MLP_RULES: Tuple[Tuple[str, Replacement], ...] = (
    (r'^transformer\.enc_out_bbox_embed\.(\d+)\.layers\.(\d+)\.',
     lambda m: f'enc_reg_branches.{m[1]}.{2 * int(m[2])}.'),
    (r'^bbox_embed\.layers\.(\d+)\.', lambda m: f'reg_branch.{2 * int(m[1])}.'),
)
#: RF-DETR's packed self-attention projection.
IN_PROJ = re.compile(r'^transformer\.decoder\.layers\.(\d+)\.self_attn\.in_proj_(weight|bias)$')
#: Parts of the model that are not the head (the backbone and projector: other converters).
NOT_HEAD = ('backbone.',)
#: RF-DETR's keypoint schema buffer: empty (0 x 0) in a detection model, dropped.
KEYPOINT_MASK = '_kp_active_mask'


def rfdetr_head_key(key: str) -> str:
    """Our :class:`LWDETRHead` key of an RF-DETR head key (not ``in_proj_*``, see
    :func:`rfdetr_head_state_dict`); raises ``KeyError`` for a key no rule knows."""
    new = rename(key, HEAD_RULES + BOX_MLP_RULES)
    if new is not None:
        return new
    raise KeyError(f'{key!r} is not a key of an RF-DETR (LW-DETR) detection head; is this an '
                   'RF-DETR checkpoint of the detection model?')


def rfdetr_head_state_dict(state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The head entries of an RF-DETR ``model`` state dict (everything outside
    :data:`NOT_HEAD`), under our :class:`LWDETRHead` keys."""
    out: Dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith(NOT_HEAD):
            continue
        if key == KEYPOINT_MASK:
            if value.numel():
                raise ValueError(f'the checkpoint has a keypoint schema ({KEYPOINT_MASK} of shape '
                                 f'{tuple(value.shape)}): RF-DETR keypoint models are not '
                                 'supported; load a detection checkpoint')
            continue
        packed = IN_PROJ.match(key)
        if packed:
            layer, kind = packed.groups()
            for name, part in zip(('q_proj', 'k_proj', 'v_proj'), value.chunk(3)):
                out[f'decoder.layers.{layer}.self_attn.{name}.{kind}'] = part
            continue
        out[rfdetr_head_key(key)] = value
    return out
