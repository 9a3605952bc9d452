"""The ViT families under graph capture: fullgraph ``torch.compile`` (training and inference,
fp32: outputs and gradients equal eager) and ONNX export with dynamic sizes checked with
onnxruntime (as ``tests/models/backbones/test_compile.py`` / ``tests/deploy/test_export.py``
do for the ViT)."""
import pytest
import torch
from helpers import max_rel_err, randomize_
from test_export import _export_and_check

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.onnx_export import DetectorPart
from vitdet_plugin.models.backbones import DINOv2Backbone, DINOv3Backbone, EVA02Backbone

FP32_TOL = 1e-5
#: One windowed configuration per family (padded windows, prefix tokens, both rope options).
MODELS = {
    'dinov2': lambda: DINOv2Backbone(arch=dict(embed_dims=32, depth=2, num_heads=2,
                                               num_reg_tokens=2, global_attn_indexes=(1,)),
                                     patch_size=8, window_size=3, pretrain_img_size=48),
    'dinov3': lambda: DINOv3Backbone(arch=dict(embed_dims=32, depth=2, num_heads=2,
                                               qkv_bias='qv', global_attn_indexes=(1,)),
                                     patch_size=8, window_size=3, rope_coords='global'),
    'eva02': lambda: EVA02Backbone(arch=dict(embed_dims=32, depth=2, num_heads=2,
                                             global_attn_indexes=(1,)),
                                   patch_size=8, window_size=3, pretrain_img_size=48,
                                   rope=dict(temperature=1e4, ref_grid=(6, 6))),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(model, x, training):
    x = x.clone().requires_grad_(training)
    with torch.set_grad_enabled(training):
        outs = list(model(x))
    if not training:
        return outs, []
    params = list(getattr(model, '_orig_mod', model).parameters())
    w = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(1))
    return [o.detach() for o in outs], list(torch.autograd.grad((outs[0] * w).sum(), [x] + params))


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name', list(MODELS))
def test_fullgraph_compile_matches_eager(name, training):
    model = randomize_(MODELS[name]()).train(training)
    x = torch.randn(2, 3, 70, 101)
    ref_outs, ref_grads = _run(model, x, training)
    outs, grads = _run(torch.compile(model, backend='aot_eager', fullgraph=True), x, training)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert max_rel_err(got, want) <= FP32_TOL


@pytest.mark.parametrize('name', ['dinov3', 'eva02'])  # DINOv2's path is a subset of EVA-02's
def test_exports_with_dynamic_sizes(name, tmp_path):
    """Rope tables (window and global coordinates), the resized position grid, prefix tokens
    joining padded windows: built inside the graph for each input size."""
    _export_and_check(DetectorPart(randomize_(MODELS[name]()), 'backbone'), tmp_path)
