"""The query positions each decoder layer gets: D-FINE (and transformers' DEIMv2) recompute
them from each layer's input references; the official DEIMv2 decoder
(Intellindust-AI-Lab/DEIMv2 ``engine/deim/deim_decoder.py``, ``TransformerDecoder.forward``)
computes them once, before its layer loop:

    ref_points_detach = F.sigmoid(ref_points_unact)
    query_pos_embed = query_pos_head(ref_points_detach).clamp(min=-10, max=10)
    for i, layer in enumerate(self.layers):
        output = layer(output, ref_points_input, value, spatial_shapes, attn_mask, query_pos_embed)
        ...
        ref_points_detach = inter_ref_bbox.detach()

(``query_pos_per_layer=False``). Each layer's ``pos`` argument is recorded and compared with
that formula written out."""
from typing import List, Tuple

import pytest
import torch
from torch import Tensor

from vitdet_plugin.models.heads.dfine_decoder import DFineDecoder

#: The official clamp of the query position embeddings.
CLAMP = 10.0
NUM_CLASSES = 3


def _run(per_layer: bool) -> Tuple[DFineDecoder, List[Tensor], List[Tensor], Tensor]:
    """A seeded 3-layer DEIMv2 decoder's recorded ``pos`` and ``ref`` per layer, and the
    selected reference logits."""
    torch.manual_seed(0)
    decoder = DFineDecoder(NUM_CLASSES, 32, 2, 64, 3, [2, 2], style='deimv2',
                           query_pos_act='silu', mlp_act='silu',
                           query_pos_per_layer=per_layer).eval()
    memory, shapes = torch.randn(1, 20, 32), [(4, 4), (2, 2)]
    query, ref = torch.randn(1, 6, 32), torch.randn(1, 6, 4)
    pos: List[Tensor] = []
    refs: List[Tensor] = []
    for layer in decoder.layers:
        layer.register_forward_pre_hook(
            lambda _, args: (pos.append(args[1]), refs.append(args[2])) and None)
    with torch.no_grad():
        decoder(query, ref, memory, shapes)
    return decoder, pos, refs, ref


@pytest.mark.parametrize('per_layer', [False, True])
def test_each_layers_query_positions(per_layer):
    decoder, pos, refs, ref_logits = _run(per_layer)
    assert len(pos) == 3
    with torch.no_grad():
        official = decoder.query_pos_head(ref_logits.sigmoid()).clamp(-CLAMP, CLAMP)
        assert torch.equal(pos[0], official)
        for i in (1, 2):
            assert not torch.equal(refs[i], refs[0])  # the layers' references move
            want = (decoder.query_pos_head(refs[i]).clamp(-CLAMP, CLAMP) if per_layer
                    else official)
            assert torch.equal(pos[i], want), i
