"""``RFDETRProjector`` against the ``rfdetr`` package's ``MultiScaleProjector``: the same weights
(rfdetr's own state dict, through our key map) give the same pyramid."""
import pytest
import torch
from mmdet.registry import MODELS
from rfdetr.models.backbone.projector import MultiScaleProjector
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights.rfdetr_keys import (RFDETR_PROJECTOR_PREFIX,
                                                    rfdetr_projector_key,
                                                    rfdetr_projector_state_dict)
from vitdet_plugin.models.necks.rfdetr_projector import RFDETRProjector

#: Shrunk RF-DETR projector: 4 taps of 32 channels (ViT-S: 384), 32 outputs (256).
TAPS, WIDTH, OUT = 4, 32, 32
#: rfdetr's level -> scale factor (its backbone's table; P6 is the projector's 0.25 marker).
SCALES = {'P3': 2.0, 'P4': 1.0, 'P5': 0.5, 'P6': 0.25}
#: Relative tolerance of the parity (issue 50: 1e-5 relative).
REL_TOL = 1e-5


def _randomize(module: nn.Module, seed: int) -> None:
    """Every parameter random (norm weights / biases too, so a swapped key cannot pass)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _pair(levels, layer_norm=True, blocks=3):
    ref = MultiScaleProjector([WIDTH] * TAPS, OUT, [SCALES[lvl] for lvl in levels],
                              num_blocks=blocks, layer_norm=layer_norm).eval()
    _randomize(ref, seed=len(levels))
    norm_cfg = dict(type='LN2d', eps=1e-6) if layer_norm else dict(type='BN')
    ours = MODELS.build(dict(type='RFDETRProjector', in_channels=[WIDTH] * TAPS,
                             out_channels=OUT, levels=levels, num_blocks=blocks,
                             norm_cfg=norm_cfg)).eval()
    state = {RFDETR_PROJECTOR_PREFIX + k: v for k, v in ref.state_dict().items()}
    ours.load_state_dict(rfdetr_projector_state_dict(state), strict=True)
    return ref, ours


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize('levels,size', [(('P4',), (12, 12)), (('P4',), (10, 14)),
                                         (('P3', 'P4', 'P5', 'P6'), (12, 12)),
                                         (('P3', 'P5'), (10, 14))])
def test_projector_matches_rfdetr(levels, size):
    ref, ours = _pair(levels)
    gen = torch.Generator().manual_seed(7)
    taps = [torch.randn(2, WIDTH, *size, generator=gen) for _ in range(TAPS)]
    with torch.no_grad():
        expected = ref(list(taps))
        got = ours(taps)
    assert len(got) == len(expected) == len(levels)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert _rel_err(g, e) <= REL_TOL
    strides = {'P3': 8, 'P4': 16, 'P5': 32, 'P6': 64}
    assert ours.out_strides == tuple(strides[lvl] for lvl in levels)
    assert ours.out_channels == (OUT,) * len(levels)


def test_projector_batchnorm_variant_matches_rfdetr():
    """RF-DETR's ``layer_norm=False`` (BatchNorm, eval statistics loaded too)."""
    ref, ours = _pair(('P4', 'P5'), layer_norm=False, blocks=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    state = {RFDETR_PROJECTOR_PREFIX + k: v for k, v in ref.state_dict().items()}
    ours.load_state_dict(rfdetr_projector_state_dict(state), strict=True)
    taps = [torch.randn(1, WIDTH, 8, 8, generator=gen) for _ in range(TAPS)]
    with torch.no_grad():
        for g, e in zip(ours(taps), ref(list(taps))):
            assert _rel_err(g, e) <= REL_TOL


def test_projector_key_map_rejects_unknown_key():
    with pytest.raises(KeyError, match=r"'blocks\.0\.weight' is not a key of an RF-DETR "
                                       r'projector'):
        rfdetr_projector_key('blocks.0.weight')


def test_projector_bad_arguments():
    with pytest.raises(ValueError, match=r"levels=\('P6',\) must be distinct levels"):
        RFDETRProjector(levels=('P6',))
    with pytest.raises(ValueError, match=r"levels=\('P5', 'P4'\) must be distinct levels"):
        RFDETRProjector(levels=('P5', 'P4'))
    ours = RFDETRProjector(in_channels=[WIDTH] * 2, out_channels=OUT, num_blocks=1)
    with pytest.raises(ValueError, match=r'expects 2 maps with channels \[32, 32\]'):
        ours([torch.zeros(1, WIDTH, 4, 4)])
