"""ONNX export with dynamic batch / height / width (torch's dynamo exporter) and onnxruntime
parity with PyTorch at three input sizes that are no multiple of a patch, window or stride:
Swin V2 (make test-all) and ViT (+ its simple-pyramid neck) backbones, and RetinaNet's raw
head outputs from ``configs/swin_retinanet.py`` through ``tools/export_onnx.py``, whose Swin
(shifted windows and their masks in the first two stages, padding to the window in every
stage) is the Swin V1 check."""
import os.path as osp
import re

import onnxruntime  # noqa: F401  (the deploy extra, installed by make env)
import onnxscript  # noqa: F401
import pytest
import torch
from helpers import REPO_ROOT, load_tool, randomize_

import vitdet_plugin  # noqa: F401
from vitdet_plugin.deploy.onnx_export import DetectorPart, build_detector_part, export_onnx
from vitdet_plugin.deploy.ort_check import CHECK_SIZES, DEFAULT_TOLERANCE, check_sizes, ort_session
from vitdet_plugin.models.backbones import SwinBackbone, SwinV2Backbone, ViTBackbone
from vitdet_plugin.models.necks import ViTSimpleFPN

ROOT = str(REPO_ROOT)
#: Batch of the check images: another batch than the export's example (2), so a batch baked
#: into the graph fails.
CHECK_BATCH = 1
#: configs/swin_retinanet.py shrunk (Swin-T would take minutes to export on 2 cores); the
#: structure (4 stages, window 7, FPN with extra convs on the input, RetinaHead) is the
#: config's own; two blocks in the first two stages (a shifted-window block each).
TINY_RETINANET = {
    'model.backbone.embed_dims': 16,
    'model.backbone.depths': [2, 2, 1, 1],
    'model.backbone.num_heads': [1, 1, 2, 2],
    'model.neck.in_channels': [32, 64, 128],
    'model.neck.out_channels': 16,
    'model.bbox_head.in_channels': 16,
    'model.bbox_head.feat_channels': 16,
    'model.bbox_head.stacked_convs': 1,
    'model.backbone.init_cfg': None,  # offline: not the config's ImageNet Swin-T
}


def _export_and_check(module: DetectorPart, tmp_path) -> None:
    path = str(tmp_path / 'model.onnx')
    names = export_onnx(module, path)
    session = ort_session(path)
    assert [o.name for o in session.get_outputs()] == names
    image = session.get_inputs()[0]
    assert [isinstance(d, str) for d in image.shape] == [True, False, True, True], image.shape
    checks = check_sizes(session, module, module.in_channels, CHECK_SIZES, CHECK_BATCH)
    assert [c.size for c in checks] == list(CHECK_SIZES)
    for c in checks:
        assert c.max_error <= DEFAULT_TOLERANCE, (c.size, c.errors)


#: make test-all: Swin V2's window flow (pads, shifts, masks: functional/window.py) is Swin V1's,
#: exported in the default suite (RetinaNet here, the DETR and Mask R-CNN graphs); what is its
#: own (cosine attention, the position-bias MLP on a constant table, post-norm) is plain
#: MatMul / ReLU / Exp / LayerNorm. 41 s of the default suite's time (CI, 2026-12-03).
@pytest.mark.slow
def test_swinv2_backbone_exports_with_dynamic_sizes(tmp_path):
    """Cosine attention, the continuous position bias MLP and post-norm patch merging."""
    model = randomize_(SwinV2Backbone(arch=dict(embed_dims=16, depths=(2, 2, 2),
                                                num_heads=(1, 2, 2)),
                                      window_size=7, out_indices=(0, 1, 2)))
    _export_and_check(DetectorPart(model, 'backbone'), tmp_path)


#: the ViT alone runs in make test-all: the pyramid case exports the same backbone, then its neck
@pytest.mark.parametrize('pyramid', [pytest.param(None, marks=pytest.mark.slow),
                                     dict(out_channels=16)], ids=['plain', 'pyramid'])
def test_vit_backbone_exports_with_dynamic_sizes(tmp_path, pyramid):
    """Window and global blocks, the position embedding and the global blocks' relative
    tables resized to the input grid inside the graph (and the simple-pyramid neck)."""
    model = randomize_(ViTBackbone(embed_dims=32, depth=2, num_heads=2, global_attn_indexes=(1,),
                                   window_size=14, img_size=224))
    if pyramid is None:
        _export_and_check(DetectorPart(model, 'backbone'), tmp_path)
        return
    detector = torch.nn.Module()  # backbone + neck, the parts DetectorPart exports
    detector.backbone = model
    detector.neck = randomize_(ViTSimpleFPN(in_channels=32, num_outs=4, **pyramid))
    _export_and_check(DetectorPart(detector, 'neck'), tmp_path)


def test_retinanet_raw_outputs_export_through_the_tool(tmp_path, capsys):
    """backbone + FPN + RetinaHead: per-level class logits and box deltas before NMS (and the
    Swin V1 backbone's export at sizes that pad every stage)."""
    tool = load_tool('export_onnx.py')
    out = tmp_path / 'retinanet.onnx'
    options = [f'{k}={v!r}'.replace(' ', '') for k, v in TINY_RETINANET.items()]
    code = tool.main([osp.join(ROOT, 'configs', 'swin_retinanet.py'), '--out', str(out),
                      '--part', 'head', '--repeats', '1', '--cfg-options', *options])
    text = capsys.readouterr().out
    assert code == 0, text
    names = [f'cls_score_{i}' for i in range(5)] + [f'bbox_pred_{i}' for i in range(5)]
    assert f'outputs {", ".join(names)}' in text
    for h, w in CHECK_SIZES:
        line = re.search(rf'{h}x{w} batch 1: max rel\. error (\S+) .* ok', text)
        assert line and float(line.group(1)) <= DEFAULT_TOLERANCE, text
    assert re.search(r'latency 801x1217 batch 1 .*onnxruntime [\d.]+ ms, PyTorch [\d.]+ ms',
                     text), text


def test_parts_that_cannot_be_exported_are_named():
    two_stage = osp.join(ROOT, 'configs', 'swin_mask_rcnn.py')
    with pytest.raises(ValueError, match='two-stage detector: its RoI head needs RoIAlign'):
        build_detector_part(two_stage, part='head', cfg_options={'model.backbone.init_cfg': None})
    backbone = SwinBackbone(arch=dict(embed_dims=16, depths=(1,), num_heads=(1,)), out_indices=(0,))
    with pytest.raises(ValueError, match='needs a detector'):
        DetectorPart(backbone, 'neck')
    with pytest.raises(ValueError, match="part='trunk' is not one of"):
        DetectorPart(backbone, 'trunk')


def test_mismatched_checkpoint_is_named(tmp_path):
    from vitdet_plugin.weights.checkpoint_io import CheckpointError
    path = tmp_path / 'other.pth'
    torch.save({'state_dict': {'backbone.nothing': torch.zeros(1)}}, path)
    config = osp.join(ROOT, 'configs', 'swin_retinanet.py')
    with pytest.raises(CheckpointError, match='does not match the model of'):
        build_detector_part(config, str(path), cfg_options=dict(TINY_RETINANET))


class _LinearGelu(torch.nn.Module):
    """A ViT MLP's first half: Linear -> exact GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.act = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_linear_and_gelu_export_in_the_forms_onnxruntime_fuses(tmp_path):
    """Our translations of ``aten.linear`` and ``aten.gelu`` (every export of ours) become one
    ``Gemm`` and one ``Gelu`` kernel in onnxruntime's optimised graph at dynamic token counts
    (torch's own leave MatMul + Add and Div / Erf / Add / Mul / Mul), with the same values at
    another size than the traced one."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from vitdet_plugin.deploy.graph_ops import translation_table

    module = _LinearGelu().eval()
    dynamic = torch.export.Dim.DYNAMIC
    path, optimised = str(tmp_path / 'gelu.onnx'), str(tmp_path / 'gelu.opt.onnx')
    torch.onnx.export(module, (torch.randn(2, 5, 8),), path, dynamo=True, external_data=False,
                      dynamic_shapes=({0: dynamic, 1: dynamic},),
                      custom_translation_table=translation_table())
    options = ort.SessionOptions()
    options.optimized_model_filepath = optimised
    session = ort.InferenceSession(path, options, providers=['CPUExecutionProvider'])
    shape_ops = ('Shape', 'Concat', 'Reshape')  # the tokens flattened and back
    ops = sorted(n.op_type for n in onnx.load(optimised).graph.node if n.op_type not in shape_ops)
    assert ops == ['Gelu', 'Gemm'], ops
    x = torch.randn(3, 7, 8) * 3
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, module(x).detach().numpy(), rtol=1e-6, atol=1e-6)
