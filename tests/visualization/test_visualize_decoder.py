"""tools/analysis/visualize.py decoder: the boxes drawn per stage against the head's own outputs,
the cross-attention recomputed from captured inputs against the module's output (padded tokens
exactly zero), the picture's size for a random-init model and a checkpoint, learned reference
boxes (two_stage=False), and the error messages."""
import os.path as osp
import re
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from helpers import REPO_ROOT, load_tool

from vitdet_plugin.functional import attend
from vitdet_plugin.visualization import VisualizeError
from vitdet_plugin.visualization.capture import Call
from vitdet_plugin.visualization.decoder import (cross_attention_output, cross_attention_probs,
                                                 decoder_picture)
from vitdet_plugin.visualization.figures import PANEL_PX
from vitdet_plugin.visualization.model import build_detector, image_input

ROOT = str(REPO_ROOT)
visualize = load_tool('analysis/visualize.py')

#: The demo SdpaDETR shrunk: Swin 16 wide (strides 8/16/32, 32/64/128 channels), head 32 wide,
#: 2 heads, 2 decoder layers, 10 queries, no denoising; images resized to 128 px.
TINY_DETR = f'''
_base_ = [{osp.join(ROOT, 'configs/demo/swin_detr_demo.py')!r}]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                          'scale_factor')),
]
test_dataloader = dict(dataset=dict(pipeline=test_pipeline))
model = dict(
    backbone=dict(arch=dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1]),
                  window_size=4),
    bbox_head=dict(in_channels=[32, 64, 128], embed_dims=32, num_heads=2, ffn_dims=64,
                   num_decoder_layers=2, num_queries=10, dn_cfg=None))
'''
LAYERS, QUERIES, HEADS = 2, 10, 2
#: The 150 x 260 image is resized to 74 x 128 (img_shape) and padded to 96 x 128: memory levels
#: 12 x 16, 6 x 8 and 3 x 4, of which the bottom 2, 1 and 0 rows are padding.
IMG_SHAPE, BATCH_SHAPE = (74, 128), (96, 128)
LEVELS, VALID_ROWS = [(12, 16), (6, 8), (3, 4)], [10, 5, 3]
#: Panels: 1 + LAYERS refinement stages on top, the 3 levels and a note below.
COLS, ROWS = 4, 2
LEARNED_REFS = ['--cfg-options', 'model.bbox_head.two_stage=False']


@pytest.fixture(scope='module')
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp('cfg') / 'tiny_detr.py'
    path.write_text(TINY_DETR)
    return str(path)


@pytest.fixture(scope='module')
def image(tmp_path_factory) -> str:
    """Two rectangles on a gradient, 150 x 260 (wider than high, so the batch is padded)."""
    import mmcv
    h, w = 150, 260
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None]
    img[..., 1] = np.linspace(255, 0, h, dtype=np.uint8)[:, None]
    img[30:80, 40:100] = (20, 200, 240)
    img[90:140, 150:230] = (240, 40, 60)
    path = str(tmp_path_factory.mktemp('img') / 'shapes.png')
    mmcv.imwrite(img, path)
    return path


def _saved(config: str, tmp_path: Any, name: str, options: Dict[str, Any]) -> Tuple[Any, str]:
    """A detector with every weight random (so each layer moves the boxes) and its checkpoint."""
    from helpers import randomize_
    detector = build_detector(config, cfg_options=options or None)
    randomize_(detector.model, seed=5)
    ckpt = str(tmp_path / name)
    torch.save({'state_dict': detector.model.state_dict()}, ckpt)
    return detector, ckpt


def _batch(detector: Any, image: str) -> Tuple[torch.Tensor, dict]:
    """``image`` through the test pipeline and the data preprocessor (our own calls): the
    inputs and the sample's metainfo."""
    import mmcv
    from mmcv.transforms import Compose
    from mmengine.dataset import pseudo_collate
    pipeline = Compose([dict(type='mmdet.LoadImageFromNDArray'),
                        dict(type='Resize', scale=(128, 128), keep_ratio=True),
                        dict(type='mmdet.PackDetInputs')])
    data = pipeline(dict(img=mmcv.imread(image), img_id=0))
    with torch.no_grad():
        batch = detector.model.data_preprocessor(pseudo_collate([data]), False)
    meta = batch['data_samples'][0].metainfo
    assert tuple(meta['img_shape']) == IMG_SHAPE and tuple(meta['batch_input_shape']) == \
        BATCH_SHAPE
    return batch['inputs'], meta


def _head_run(detector: Any, image: str) -> Tuple[Any, List[Call], List[torch.Tensor]]:
    """The head's outputs on ``image`` and, per decoder layer, its cross-attention's inputs
    and output (our own hooks)."""
    model = detector.model
    inputs, meta = _batch(detector, image)
    calls: List[Call] = []
    outs: List[torch.Tensor] = []
    handles = []
    for layer in model.bbox_head.decoder.layers:
        handles.append(layer.cross_attn.register_forward_pre_hook(
            lambda m, a, k: calls.append(Call(a, k)), with_kwargs=True))
        handles.append(layer.cross_attn.register_forward_hook(lambda m, a, o: outs.append(o)))
    with torch.no_grad():
        head_outs = model.bbox_head(model.extract_feat(inputs), [meta])
    for h in handles:
        h.remove()
    return head_outs, calls, outs


def _pixels(boxes: torch.Tensor) -> np.ndarray:
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    h, w = IMG_SHAPE
    return (bbox_cxcywh_to_xyxy(boxes) * torch.tensor([w, h, w, h])).numpy()


def _png(path: str) -> None:
    pixels = imread(path)
    assert pixels.shape[:2] == (ROWS * PANEL_PX, COLS * PANEL_PX), pixels.shape
    assert pixels[..., :3].std() > 0.05, 'the picture is (nearly) one colour'


def _padded_tokens() -> torch.Tensor:
    """``(N,)`` True at the memory tokens below each level's valid rows."""
    return torch.cat([(torch.arange(h) >= rows)[:, None].expand(h, w).flatten()
                      for (h, w), rows in zip(LEVELS, VALID_ROWS)])


# ----------------------------------------------------------------------------- pictures
def test_random_init_picture_size(tmp_path, config, image):
    pic = visualize.main(['decoder', config, '--image', image, '--out', str(tmp_path / 'd.png')])
    assert pic.size_px == (COLS * PANEL_PX, ROWS * PANEL_PX)
    _png(pic.path)
    assert [pic.arrays[f'attention level {lvl}'].shape for lvl in range(3)] == LEVELS


@pytest.mark.parametrize('two_stage', [True, False])
def test_drawn_boxes_are_the_heads_outputs(tmp_path, config, image, two_stage):
    options = {} if two_stage else {'model.bbox_head.two_stage': False}
    detector, ckpt = _saved(config, tmp_path, 'w.pth', options)
    top, rank = 4, 1
    pic = visualize.main(['decoder', config, ckpt, '--image', image, '--top', str(top),
                          '--query', str(rank), '--layer', '0',
                          *([] if two_stage else LEARNED_REFS), '--out', str(tmp_path / 'd.png')])
    _png(pic.path)
    outs, _, _ = _head_run(detector, image)
    best, labels = outs.all_cls_scores[-1, 0].sigmoid().max(dim=-1)
    scores, index = best.topk(top)
    np.testing.assert_array_equal(pic.arrays['queries'], index.numpy())
    np.testing.assert_allclose(pic.arrays['scores'], scores.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(pic.arrays['labels'], labels[index].numpy())
    head = detector.model.bbox_head
    initial = outs.enc_bbox_preds[0] if two_stage else head.ref_logits.detach().sigmoid()
    assert (outs.enc_bbox_preds is not None) == two_stage
    np.testing.assert_allclose(pic.arrays['boxes initial'], _pixels(initial[index]),
                               rtol=1e-5, atol=1e-4)
    for i in range(LAYERS):
        np.testing.assert_allclose(pic.arrays[f'boxes layer {i}'],
                                   _pixels(outs.all_bbox_preds[i, 0, index]), rtol=1e-5,
                                   atol=1e-4)
    assert not np.allclose(pic.arrays['boxes layer 0'], pic.arrays['boxes initial'])
    # layer 0's input reference box is the initial one
    np.testing.assert_array_equal(pic.arrays['reference box'], pic.arrays['boxes initial'][rank])


def test_drawn_attention_is_the_modules(tmp_path, config, image):
    detector, ckpt = _saved(config, tmp_path, 'w.pth', {})
    pic = visualize.main(['decoder', config, ckpt, '--image', image, '--query', '2', '--head',
                          '1', '--out', str(tmp_path / 'd.png')])
    outs, calls, _ = _head_run(detector, image)
    module = detector.model.bbox_head.decoder.layers[-1].cross_attn
    call = calls[-1]
    query, key, bias = call.args[0], call.args[1], call.args[3]
    q, k = module._heads(module.q_proj(query)), module._heads(module.k_proj(key))
    n = key.shape[1]
    with torch.no_grad():  # the model's attention core with identity values gives its weights
        probs = attend(q, k, torch.eye(n).expand(1, HEADS, n, n), bias)
    row = probs[0, 1, int(pic.arrays['queries'][2])]
    start = 0
    for lvl, (h, w) in enumerate(LEVELS):
        np.testing.assert_allclose(pic.arrays[f'attention level {lvl}'],
                                   row[start:start + h * w].reshape(h, w).numpy(), atol=1e-6)
        start += h * w
    np.testing.assert_allclose(pic.arrays['reference box'],
                               _pixels(outs.all_bbox_preds[-2, 0, pic.arrays['queries'][2]]),
                               rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- recomputation
def test_recomputed_cross_attention_gives_the_modules_output(tmp_path, config, image):
    detector, _ = _saved(config, tmp_path, 'w.pth', {})
    _, calls, outs = _head_run(detector, image)
    padded = _padded_tokens()
    assert len(calls) == LAYERS and padded.any() and not padded.all()
    for layer, call, out in zip(detector.model.bbox_head.decoder.layers, calls, outs):
        bias = call.args[3]
        assert torch.equal(torch.isinf(bias).all(dim=(1, 2))[0], padded)  # the padding mask
        assert torch.isfinite(bias[..., ~padded]).all() and bias[..., ~padded].std() > 0  # prior
        probs = cross_attention_probs(layer.cross_attn, call)
        assert probs.shape == (1, HEADS, QUERIES, padded.numel())
        np.testing.assert_allclose(cross_attention_output(layer.cross_attn, call, probs), out,
                                   atol=1e-5)
        np.testing.assert_allclose(probs.sum(-1), np.ones((1, HEADS, QUERIES)), atol=1e-5)
        assert torch.all(probs[..., padded] == 0)
        assert torch.all(probs[..., ~padded] > 0)


# ----------------------------------------------------------------------------- errors
def test_error_messages(tmp_path, config, image):
    out = str(tmp_path / 'x.png')
    demo = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')
    with pytest.raises(SystemExit) as info:
        visualize.main(['decoder', demo, '--image', image, '--out', out])
    assert str(info.value.code) == (
        f'error: {demo}: RetinaNet has bbox_head RetinaHead, not an SdpaDETRHead; the decoder '
        'picture needs a DETR-style head with model.bbox_head.decoder.layers')
    detector = build_detector(config)
    inp = image_input(detector, image)
    cases = [
        (dict(layer=2), 'layer 2 is out of range: the decoder of SdpaDETRHead has 2 layers '
                        '(0..1, or -2..-1 from the end)'),
        (dict(layer=-3), 'layer -3 is out of range: the decoder of SdpaDETRHead has 2 layers '
                         '(0..1, or -2..-1 from the end)'),
        (dict(top=5, query=5), '--query 5 is out of range: it is a rank among the --top 5 '
                               'queries, so it must be in 0..4'),
        (dict(top=11), '--top 11 is out of range: SdpaDETRHead has 10 queries, so --top must '
                       'be in 1..10'),
        (dict(top=0), '--top 0 is out of range: SdpaDETRHead has 10 queries, so --top must be '
                      'in 1..10'),
        (dict(head=2), 'head 2 is out of range: the cross-attention of decoder layer 1 has 2 '
                       'heads (0..1)'),
    ]
    for kwargs, message in cases:
        args = {**dict(top=5, query=0, layer=None, head=None), **kwargs}
        with pytest.raises(VisualizeError, match=f'^{re.escape(message)}$'):
            decoder_picture(detector, inp, args['top'], args['query'], args['layer'],
                            args['head'], out)
    assert not osp.exists(out)


def test_default_output_path(config):
    args = visualize.build_parser().parse_args(['decoder', config, '--image', 'x.png'])
    assert (args.top, args.query, args.layer, args.head) == (5, 0, None, None)
    assert visualize.default_out(args) == osp.join('work_dirs', 'visualize',
                                                   'tiny_detr_decoder.png')
