"""transformers D-FINE / DEIMv2 checkpoint keys -> our decoder / selector keys (strict loads of
the renamed reference state dicts are in tests/models/heads/test_dfine_decoder.py)."""
import pytest
import torch

from dfine_reference import reference_model
from vitdet_plugin.weights.dfine_keys import check_bins, dfine_decoder_key, dfine_head_state_dict


@pytest.mark.parametrize('style', ['dfine', 'deimv2'])
def test_every_decoder_entry_is_renamed_or_rebuilt(style):
    state = reference_model(style).state_dict()
    ours = dfine_head_state_dict(state)
    decoder_keys = [k for k in state if k.startswith('model.decoder.')]
    rebuilt = [k for k in decoder_keys if k.endswith(('.up', '.reg_scale', 'num_points_scale'))]
    assert len([k for k in ours if k.startswith('decoder.')]) == len(decoder_keys) - len(rebuilt)
    assert 'decoder.layers.0.self_attn.out_proj.weight' in ours
    assert 'selector.enc_output.1.weight' in ours and 'dn_label_embed.weight' in ours
    assert not any(k.startswith(('model.backbone', 'model.encoder')) for k in ours)


def test_unknown_decoder_key_names_the_expected_checkpoint():
    with pytest.raises(KeyError, match=r"'layers\.0\.cross_attn\.value_proj\.weight' is not a "
                                       r"key of a transformers D-FINE / DEIMv2 decoder"):
        dfine_decoder_key('layers.0.cross_attn.value_proj.weight')


def test_bins_that_differ_from_the_config_are_refused():
    state = {'model.decoder.up': torch.tensor([0.5]),
             'model.decoder.reg_scale': torch.tensor([8.0])}
    check_bins(state, up=0.5, reg_scale=8.0)
    with pytest.raises(ValueError, match=r'the checkpoint has reg_scale=\[8\.0\] but the decoder '
                                         r'was built with reg_scale=4\.0; set reg_scale=8'):
        check_bins(state, up=0.5, reg_scale=4.0)
