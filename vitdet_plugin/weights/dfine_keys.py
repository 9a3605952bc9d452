"""transformers ``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` checkpoints -> our
D-FINE / DEIMv2 decoder, query selector and denoising embedding state dicts.

Pure renames over the transformers state dict (``model.safetensors`` keys):

- ``model.decoder.*`` (with its ``class_embed`` / ``bbox_embed`` copies) -> :class:`~vitdet_plugin.
  models.heads.dfine_decoder.DFineDecoder` under ``decoder.`` (:data:`DECODER_RULES`);
- ``model.enc_output`` / ``enc_score_head`` / ``enc_bbox_head`` / ``weight_embedding`` ->
  :class:`~vitdet_plugin.models.heads.dfine_decoder.DFineQuerySelector` under ``selector.``;
- ``model.denoising_class_embed`` -> ``dn_label_embed`` (the ``nn.Embedding`` given to
  :func:`~vitdet_plugin.models.heads.dfine_decoder.contrastive_denoising_group`).

The top-level ``class_embed`` / ``bbox_embed`` are the same weights as the decoder's copies and
are skipped, as are the constants ``decoder.up`` / ``decoder.reg_scale`` and the buffer
``num_points_scale`` (our decoder builds them from its arguments; :func:`check_bins` compares
them). The backbone and encoder (``model.backbone`` / ``model.conv_encoder`` /
``model.encoder`` / ``model.encoder_input_proj`` / ``model.decoder_input_proj``) belong to
other converters and are left out.
"""
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .rfdetr_keys import Replacement, rename

#: prefix of the decoder in a transformers detection checkpoint.
DECODER_PREFIX = 'model.decoder.'
#: ``(pattern inside the decoder, our DFineDecoder key)``, tried in order. One table for both
#: spellings: transformers' (``o_proj``, ``encoder_attn``, ``mlp.*``, ``class_embed``) and the
#: official repositories' (``out_proj``, ``cross_attn``, ``linear1`` / ``swish_ffn.w3``,
#: ``dec_score_head``; their fused ``in_proj`` / ``w12`` are split into the transformers names
#: first, :mod:`.dfine_official`).
DECODER_RULES: Tuple[Tuple[str, Replacement], ...] = (
    (r'^layers\.(\d+)\.self_attn\.(?:o|out)_proj\.', r'layers.\1.self_attn.out_proj.'),
    (r'^layers\.(\d+)\.self_attn\.([qkv]_proj)\.', r'layers.\1.self_attn.\2.'),
    (r'^layers\.(\d+)\.(?:self_attn_layer_norm|norm1)\.', r'layers.\1.norm1.'),
    (r'^layers\.(\d+)\.(?:encoder|cross)_attn\.(sampling_offsets|attention_weights)\.',
     r'layers.\1.cross_attn.\2.'),
    (r'^layers\.(\d+)\.(?:encoder_attn_layer_norm|norm2)\.', r'layers.\1.norm2.'),
    (r'^layers\.(\d+)\.gateway\.(gate|norm)\.', r'layers.\1.gateway.\2.'),
    (r'^layers\.(\d+)\.(?:mlp\.layers\.0|linear1)\.', r'layers.\1.ffn.fc1.'),
    (r'^layers\.(\d+)\.(?:mlp\.layers\.1|linear2)\.', r'layers.\1.ffn.fc2.'),
    (r'^layers\.(\d+)\.mlp\.gate_proj\.', r'layers.\1.ffn.fc1_g.'),
    (r'^layers\.(\d+)\.mlp\.up_proj\.', r'layers.\1.ffn.fc1_x.'),
    (r'^layers\.(\d+)\.(?:mlp\.down_proj|swish_ffn\.w3)\.', r'layers.\1.ffn.fc2.'),
    (r'^layers\.(\d+)\.(?:final_layer_norm|norm3)\.', r'layers.\1.norm3.'),
    (r'^(query_pos_head|pre_bbox_head)\.layers\.(\d+)\.', r'\1.layers.\2.'),
    (r'^lqe_layers\.(\d+)\.reg_conf\.layers\.(\d+)\.', r'lqe_layers.\1.reg_conf.layers.\2.'),
    (r'^(?:class_embed|dec_score_head)\.(\d+)\.', r'cls_branches.\1.'),
    (r'^(?:bbox_embed|dec_bbox_head)\.(\d+)\.layers\.(\d+)\.',
     r'reg_branches.\1.layers.\2.'),
)
#: decoder entries our decoder derives from its arguments.
DECODER_CONSTANTS = ('up', 'reg_scale')
#: ``(pattern, our key)`` for the two-stage selection and the denoising embedding, on the key
#: without its model prefix (transformers' ``model.``, the official decoder's ``decoder.``);
#: both spellings (``enc_output.{0,1}`` / ``enc_output.{proj,norm}``, ``weight_embedding`` /
#: ``tgt_embed``).
SELECTOR_RULES: Tuple[Tuple[str, Replacement], ...] = (
    (r'^enc_output\.(?:0|proj)\.', r'selector.enc_output.0.'),
    (r'^enc_output\.(?:1|norm)\.', r'selector.enc_output.1.'),
    (r'^enc_score_head\.', r'selector.enc_score_head.'),
    (r'^enc_bbox_head\.layers\.(\d+)\.', r'selector.enc_bbox_head.layers.\1.'),
    (r'^(?:weight_embedding|tgt_embed)\.', r'selector.weight_embedding.'),
    (r'^denoising_class_embed\.', r'dn_label_embed.'),
)
#: prefix of the selector and denoising embedding in a transformers detection checkpoint.
MODEL_PREFIX = 'model.'


def dfine_decoder_key(key: str) -> Optional[str]:
    """Our :class:`DFineDecoder` key of a transformers decoder key (without
    :data:`DECODER_PREFIX`); None for the entries we rebuild (constants, buffers); raises
    ``KeyError`` for a key no rule knows."""
    if key in DECODER_CONSTANTS or key.endswith('.num_points_scale'):
        return None
    new = rename(key, DECODER_RULES)
    if new is None:
        raise KeyError(f'{key!r} is not a key of a transformers D-FINE / DEIMv2 decoder; is '
                       f'this a DFineForObjectDetection or Deimv2ForObjectDetection checkpoint '
                       f'(decoder keys under {DECODER_PREFIX!r})?')
    return new


def dfine_head_state_dict(state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The decoder, query-selector and denoising-embedding entries of a transformers
    D-FINE / DEIMv2 detection state dict, under our keys (``decoder.``, ``selector.``,
    ``dn_label_embed.``)."""
    out: Dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith(DECODER_PREFIX):
            new = dfine_decoder_key(key[len(DECODER_PREFIX):])
            if new is not None:
                out['decoder.' + new] = value
            continue
        new = (rename(key[len(MODEL_PREFIX):], SELECTOR_RULES)
               if key.startswith(MODEL_PREFIX) else None)
        if new is not None:
            out[new] = value
    return out


def check_bins(state: Mapping[str, Tensor], up: float, reg_scale: float,
               prefix: str = DECODER_PREFIX) -> None:
    """Raise when the checkpoint's ``up`` / ``reg_scale`` differ from the decoder's arguments
    (they set the distribution bins, which our decoder builds from its arguments)."""
    for name, expected in (('up', up), ('reg_scale', reg_scale)):
        value = state.get(prefix + name)
        if value is not None and not torch.allclose(value.float(),
                                                    torch.tensor([float(expected)])):
            raise ValueError(f'the checkpoint has {name}={value.tolist()} but the decoder was '
                             f'built with {name}={expected}; set {name}={value.flatten()[0]:g} '
                             'in the decoder config')
