"""Tiny transformers D-FINE / DEIMv2 detectors (the reference) and our decoder / selector loaded
from their state dicts, shared by the decoder and loss tests."""
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from transformers import (DFineConfig, DFineForObjectDetection, Deimv2Config,
                          Deimv2ForObjectDetection, HGNetV2Config)

from vitdet_plugin.models.heads.dfine_decoder import DFineDecoder, DFineQuerySelector
from vitdet_plugin.weights.dfine_keys import check_bins, dfine_head_state_dict

#: tiny sizes: 32 channels, 2 heads, 3 decoder layers, 10 queries, 5 classes.
EMBED_DIMS, NUM_HEADS, FFN_DIMS, NUM_LAYERS, NUM_QUERIES, NUM_CLASSES = 32, 2, 64, 3, 10, 5
#: a different point count per level, as D-FINE allows.
NUM_POINTS = [3, 2, 4]
#: standard deviation of the noise added to every reference parameter.
PERTURB = 0.1


def _backbone() -> HGNetV2Config:
    return HGNetV2Config(
        stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 32, 64],
        stage_mid_channels=[8, 8, 16, 16], stage_out_channels=[16, 32, 64, 64],
        stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[1, 1, 1, 1],
        hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], out_indices=[2, 3, 4])


def reference_model(style: str, seed: int = 0, **overrides: object) -> nn.Module:
    """A tiny transformers ``DFineForObjectDetection`` (``style='dfine'``) or
    ``Deimv2ForObjectDetection``, every parameter perturbed, fp32."""
    kwargs = dict(
        backbone_config=_backbone(), encoder_in_channels=[32, 64, 64],
        encoder_hidden_dim=EMBED_DIMS, encoder_ffn_dim=64, encoder_attention_heads=NUM_HEADS,
        d_model=EMBED_DIMS, decoder_in_channels=[EMBED_DIMS] * 3, decoder_ffn_dim=FFN_DIMS,
        decoder_attention_heads=NUM_HEADS, decoder_layers=NUM_LAYERS, num_queries=NUM_QUERIES,
        num_labels=NUM_CLASSES, decoder_n_points=NUM_POINTS, num_denoising=8,
        lqe_hidden_dim=8, hidden_expansion=0.5, depth_mult=0.34)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if style == 'dfine':
        model = DFineForObjectDetection(DFineConfig(**kwargs))
    else:
        model = Deimv2ForObjectDetection(Deimv2Config(**kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('.up', '.reg_scale')):
                continue
            param.add_(torch.randn_like(param) * PERTURB)
    return model


def our_modules(reference: nn.Module, style: str) -> Tuple[DFineDecoder, DFineQuerySelector,
                                                           nn.Embedding]:
    """Our decoder, selector and denoising embedding with the reference's weights (through the
    key map, strict loading)."""
    cfg = reference.config
    decoder = DFineDecoder(
        NUM_CLASSES, EMBED_DIMS, NUM_HEADS, FFN_DIMS, NUM_LAYERS, list(cfg.decoder_n_points),
        cfg.decoder_offset_scale, cfg.max_num_bins, cfg.reg_scale, cfg.up, cfg.eval_idx,
        style=style, use_gateway=getattr(cfg, 'use_gateway', True),
        query_pos_act=cfg.decoder_activation_function, lqe_hidden_dims=cfg.lqe_hidden_dim,
        share_reg_branch=getattr(cfg, 'share_bbox_head', False),
        sampling='discrete' if cfg.decoder_method == 'discrete' else 'bilinear')
    selector = DFineQuerySelector(NUM_CLASSES, NUM_QUERIES, EMBED_DIMS,
                                  cfg.learn_initial_query)
    embed = nn.Embedding(NUM_CLASSES + 1, EMBED_DIMS, padding_idx=NUM_CLASSES)
    state = reference.state_dict()
    check_bins(state, cfg.up, cfg.reg_scale)
    ours = dfine_head_state_dict(state)
    for prefix, module in (('decoder.', decoder), ('selector.', selector),
                           ('dn_label_embed.', embed)):
        module.load_state_dict({k[len(prefix):]: v for k, v in ours.items()
                                if k.startswith(prefix)})
    return decoder, selector, embed


def capture_decoder_inputs(reference: nn.Module) -> Dict[str, object]:
    """Register a hook that records the reference decoder's keyword inputs; returns the dict
    it fills."""
    seen: Dict[str, object] = {}

    def hook(_module: nn.Module, _args: tuple, kwargs: dict) -> None:
        seen.update(kwargs)

    reference.model.decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def targets(seed: int = 1) -> List[Dict[str, Tensor]]:
    """Two images' labels in transformers' format (normalised cxcywh boxes), 3 and 1 objects."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for count in (3, 1):
        centre = torch.rand(count, 2, generator=gen) * 0.5 + 0.25
        size = torch.rand(count, 2, generator=gen) * 0.3 + 0.1
        out.append({'class_labels': torch.randint(0, NUM_CLASSES, (count,), generator=gen),
                    'boxes': torch.cat([centre, size], dim=-1)})
    return out
