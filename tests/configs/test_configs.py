"""Every config under configs/ loads, builds, trains one step and predicts on CPU; stock mmdet
Swin configs work with only the backbone type changed; data_root overrides really move data."""
import copy
import functools
import glob
import os.path as osp
import shlex
from unittest import mock

import pytest
import torch

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import DatasetNotFoundError, check_data, data_root_paths, load_config
from vitdet_plugin.models.heads.lwdetr_seg_head import LWDETRSegHead
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
CONFIGS = sorted(p for p in glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)
                 if '_base_' not in p.split(osp.sep))
CONFIG_IDS = [osp.relpath(p, osp.join(ROOT, 'configs')) for p in CONFIGS]
# mmdet's own Swin configs, loaded from the installed package (same files as
# 'mmdet::swin/...', without mmengine's pkg_resources-based package lookup)
STOCK = ['swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py',
         'swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py']


@functools.cache
def _loaded(path: str):
    return load_config(path)


def _config(path: str):
    """``load_config(path)`` (no options), parsed once per file: a copy of the parsed config
    (five tests read each config; its _base_ files are parsed only once)."""
    return copy.deepcopy(_loaded(path))


def _stock_path(name: str) -> str:
    import mmdet
    return osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', name)
TINY_HW = (96, 128)
#: A fixed-size batch pad (ViTDet's BatchFixedSizePad to 1024 x 1024) shrinks with the input:
#: the tiny images still get padded (96 -> 128 rows), to 1/64 of the area.
TINY_PAD = (128, 128)
TINY_PROPOSALS = dict(nms_pre=200, max_per_img=50)
#: Two-stage models: the width of the neck and of every head convolution / fc that follows it
#: (256 and 1024 in the configs), so that the RoI heads' 4-conv towers and their optimizer step
#: do not dominate a tiny input. The structure (convs, norms, stages) is the config's.
TINY_HEAD_WIDTH = 32
HEAD_WIDTH_KEYS = ('in_channels', 'out_channels', 'feat_channels', 'conv_out_channels',
                   'fc_out_channels')

# Small variants of our backbones, applied by backbone type (never by config name); a
# callable gets the full-size backbone (to keep its number of stages).
TINY_BACKBONE = {
    **{swin: lambda full: dict(
        embed_dims=32, depths=[2] * len(full.depths),
        num_heads=[2 ** i for i in range(len(full.depths))], window_size=4,
        drop_path_rate=0.0, init_cfg=None) for swin in ('SwinBackbone', 'SwinV2Backbone')},
    'ViTBackbone': lambda full: dict(embed_dims=64, depth=2, num_heads=2, global_attn_indexes=(1,),
                                     window_size=4, init_cfg=None),
    **{family: lambda full: dict(embed_dims=64, depth=2, num_heads=2, global_attn_indexes=(1,),
                                 window_size=4, init_cfg=None)
       for family in ('DINOv2Backbone', 'DINOv3Backbone', 'EVA02Backbone')},
    'HGNetV2Backbone': lambda full: dict(init_cfg=None, arch=dict(
        stem_channels=(3, 8, 8), in_channels=(8, 16, 24, 32), mid_channels=(8, 8, 8, 16),
        out_channels=(16, 24, 32, 48), num_blocks=(1, 1, 1, 1), num_layers=(1, 1, 1, 1),
        downsample=(False, True, True, True), light_block=(False, False, True, True),
        kernel_size=(3, 3, 5, 5))),
}


TINY_QUERIES = 30
#: RF-DETR's windowed DINOv2 (``num_windows``): its own tiling instead of ``window_size``, two
#: taps (the block after the first is global by RF-DETR's rule).
TINY_RFDETR_BACKBONE = dict(embed_dims=64, depth=2, num_heads=2, out_indices=(0, 1),
                            init_cfg=None)
#: LW-DETR heads: queries per group (each group takes that many top tokens: the runner test's
#: smallest shrunk RF-DETR input, 224 / 4 px padded to 64, has 4 x 4) and Group DETR groups.
TINY_GROUP_QUERIES = 10
#: RF-DETR's per-batch scales of the shrunk configs: around this many blocks (patch x windows)
TINY_RFDETR_BLOCKS = 2
TINY_GROUPS = 2
#: Transformer encoder / decoder depth of the shrunk DETR-style models: two layers keep what
#: depth adds (a layer refining the previous one's boxes, auxiliary losses per layer).
TINY_LAYERS = 2


def _build(cfg_model):
    from mmdet.registry import MODELS
    return MODELS.build(copy.deepcopy(cfg_model))


def _shrink(model_cfg):
    """Shrink the backbone; channel lists that consumed its outputs follow the new widths."""
    from mmdet.registry import MODELS

    bb = model_cfg.backbone
    with torch.device('meta'):  # only its contract is read: no weights to allocate or init
        full = MODELS.build(dict(copy.deepcopy(bb), init_cfg=None))
    old = getattr(full, 'out_channels', None)
    tiny = TINY_BACKBONE.get(bb.type)
    if bb.get('num_windows'):
        bb.update(TINY_RFDETR_BACKBONE)
    else:
        bb.update(tiny(full) if tiny else dict(init_cfg=None))
    neck = model_cfg.get('neck')
    if isinstance(neck, dict) and (neck.get('init_cfg') or {}).get('type') == 'Pretrained':
        # a neck from another detector's checkpoint (make demo-detr's): loading it is
        # tests/models/detectors/test_detr_pretrained_parts.py's, on a real checkpoint
        neck.init_cfg = None
    if (model_cfg.get('init_cfg') or {}).get('type') == 'Pretrained':
        # the whole detector from a file (the RF-DETR fine-tune config's): loading it is
        # tests/weights/test_rfdetr_user_path.py's, on rfdetr's own files
        model_cfg.init_cfg = None
    new = getattr(MODELS.build(copy.deepcopy(bb)), 'out_channels', None)
    if old is not None and new is not None:
        _replace_in_channels(model_cfg, list(old), list(new))
    for aug in (model_cfg.get('data_preprocessor') or {}).get('batch_augments') or []:
        if 'size' in aug:
            aug.size = TINY_PAD
        if aug.type == 'RFDETRBatchScale':  # the batch at a tiny RF-DETR training scale
            aug.resolution = TINY_RFDETR_BLOCKS * aug.block
        if aug.type == 'DEIMBatchScale':  # D-FINE / DEIMv2's multi-scale around the tiny pad
            aug.base_size = TINY_PAD[0]
    if 'rpn_head' in model_cfg:
        _narrow_heads(model_cfg, model_cfg.neck.out_channels)
    # query-based detectors pick top-k encoder tokens: a tiny input has fewer than 900
    if 'num_queries' in model_cfg:
        model_cfg.num_queries = min(model_cfg.num_queries, TINY_QUERIES)
    head = model_cfg.get('bbox_head')
    if isinstance(head, dict) and 'num_groups' in head:  # LW-DETR: top-k tokens per group
        head.update(num_queries=min(head.num_queries, TINY_GROUP_QUERIES),
                    num_groups=min(head.num_groups, TINY_GROUPS))
    if isinstance(head, dict) and head.get('type') == 'DFineHead':  # its top-k tokens, depth
        head.update(num_queries=min(head.num_queries, TINY_GROUP_QUERIES),
                    num_layers=min(head.num_layers, TINY_LAYERS))
    for part, key in (('encoder', 'num_layers'), ('decoder', 'num_layers'),
                      ('bbox_head', 'num_encoder_layers'), ('bbox_head', 'num_decoder_layers')):
        node = model_cfg.get(part)
        if isinstance(node, dict) and isinstance(node.get(key), int):
            node[key] = min(node[key], TINY_LAYERS)
    # fewer RoIs per image for two-stage models (the per-RoI heads dominate on tiny inputs)
    for cfg_key, stage, key, value in (('train_cfg', 'rcnn', 'sampler', dict(num=64)),
                                       ('train_cfg', 'rpn_proposal', None, TINY_PROPOSALS),
                                       ('test_cfg', 'rpn', None, TINY_PROPOSALS)):
        node = (model_cfg.get(cfg_key) or {}).get(stage)
        if isinstance(node, dict):
            target = node.get(key) if key else node
            if isinstance(target, dict):
                target.update(value)
    return model_cfg


def _rewrite_outside_backbone(node, rewrite) -> None:
    """Walk the dicts and lists below ``node``, never into a ``backbone``: ``rewrite(key,
    value)`` gives a key's new value, or None to keep it and walk into it."""
    if isinstance(node, list):
        for item in node:
            _rewrite_outside_backbone(item, rewrite)
    elif isinstance(node, dict):
        for key, value in node.items():
            new = rewrite(key, value)
            if new is not None:
                node[key] = new
            elif key != 'backbone':
                _rewrite_outside_backbone(value, rewrite)


def _narrow_heads(model_cfg, width: int) -> None:
    """Every channel count of the neck and the heads (not the backbone) that is the neck's
    ``width``, and every fc width, becomes :data:`TINY_HEAD_WIDTH`."""
    def narrow(key, value):
        if key in HEAD_WIDTH_KEYS and isinstance(value, int) and (
                value == width or key == 'fc_out_channels'):
            return TINY_HEAD_WIDTH
        return None

    _rewrite_outside_backbone(model_cfg, narrow)


def _replace_in_channels(model_cfg, old: list, new: list) -> None:
    """Channel lists outside the backbone that equal the backbone's channels follow the shrunk
    backbone; so does an int ``neck.in_channels`` (single-input necks)."""
    neck = model_cfg.get('neck')
    if isinstance(neck, dict) and isinstance(neck.get('in_channels'), int) \
            and neck.in_channels in old:
        neck.in_channels = new[old.index(neck.in_channels)]

    def follow(key, value):
        if key == 'in_channels' and isinstance(value, (list, tuple)) and list(value) == old:
            return list(new)
        return None

    _rewrite_outside_backbone(model_cfg, follow)


def _batch(model, with_mask: bool, num_classes: int, with_semantic: bool = False):
    from mmdet.testing import demo_mm_inputs

    packed = demo_mm_inputs(batch_size=2, image_shapes=[(3, *TINY_HW)] * 2, num_items=[3, 2],
                            num_classes=num_classes, with_mask=with_mask,
                            with_semantic=with_semantic)
    return packed


def _is_maskformer(path: str) -> bool:
    """MaskFormer / Mask2Former configs train on panoptic ground truth (per-segment masks and
    labels, stuff included) that mmdet's demo_mm_inputs does not make:
    tests/models/heads/test_mask2former.py trains and predicts them with such data."""
    return _config(path).model.type in ('MaskFormer', 'Mask2Former')


#: Configs trained and predicted here (the MaskFormer family: see _is_maskformer).
TRAINABLE = [(p, i) for p, i in zip(CONFIGS, CONFIG_IDS) if not _is_maskformer(p)]


def _num_classes(model_cfg) -> int:
    for key in ('bbox_head', 'roi_head'):
        head = model_cfg.get(key)
        if head is None:
            continue
        head = head.get('bbox_head', head)
        if isinstance(head, list):
            head = head[0]
        return head.num_classes
    raise AssertionError('no bbox head found')


def _train_and_predict(model_cfg, optim_cfg):
    from mmengine.optim import build_optim_wrapper

    torch.manual_seed(0)
    model = _build(model_cfg)
    model.init_weights()
    # instance masks: a Mask R-CNN's mask head, or a DETR head that predicts masks (RF-DETR-Seg)
    with_mask = ('mask_head' in model_cfg.get('roi_head', {})
                 or isinstance(getattr(model, 'bbox_head', None), LWDETRSegHead))
    panoptic = 'semantic_head' in model_cfg
    data = _batch(model, with_mask, _num_classes(model_cfg), with_semantic=panoptic)
    optim_cfg = copy.deepcopy(optim_cfg)
    # the one iteration is an optimizer step (RF-DETR's configs accumulate 4 iterations)
    optim_cfg.pop('accumulative_counts', None)
    amp_on_cpu = optim_cfg.get('type') == 'AmpOptimWrapper' and not torch.cuda.is_available()
    if amp_on_cpu:
        # mmengine's AmpOptimWrapper refuses to be built without an accelerator, but its
        # autocast runs on CPU in bf16 (the loss scaler disables itself without CUDA): build it
        # as on a GPU and train in bf16, so the AMP recipe itself runs
        import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module
        optim_cfg.dtype = 'bfloat16'
        with mock.patch.object(amp_module, 'is_cuda_available', lambda: True):
            optim_wrapper = build_optim_wrapper(model, optim_cfg)
        assert type(optim_wrapper).__name__ == 'AmpOptimWrapper'
    else:
        optim_wrapper = build_optim_wrapper(model, optim_cfg)
    dtypes = []
    hook = model.backbone.register_forward_hook(
        lambda m, a, out: dtypes.append({o.dtype for o in out}))
    model.train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = model.train_step(data, optim_wrapper)
    hook.remove()
    if amp_on_cpu:  # the backbone really ran under bf16 autocast
        assert dtypes == [{torch.bfloat16}], dtypes
    assert losses and all(torch.isfinite(v).all() for v in losses.values()), losses
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    frozen = model_cfg.get('frozen_parts', ())
    if 'backbone' in frozen:  # a head trained on fixed parts (make demo-detr)
        assert not [k for k in changed if k.split('.')[0] in frozen], changed
        assert any(k.startswith('bbox_head.') for k in changed)
    else:
        assert any(k.startswith('backbone.') for k in changed)
    model.eval()
    with torch.no_grad():
        results = model.test_step(data)
    assert len(results) == 2
    for r in results:
        assert r.pred_instances.bboxes.shape[-1] == 4
        if with_mask:
            assert 'masks' in r.pred_instances
        if panoptic:  # AllOutputsPanopticFPN: panoptic and semantic maps at the image size
            assert r.pred_panoptic_seg.sem_seg.shape == (1, *r.ori_shape)
            assert r.pred_sem_seg.sem_seg.shape == (1, *r.ori_shape)
    return model


def test_configs_found():
    names = set(CONFIG_IDS)
    assert {'swin_retinanet.py', 'swin_mask_rcnn.py', 'swin_mask_rcnn_3x_ms_amp.py',
            'demo/swin_retinanet_shapes.py', 'demo/swin_mask_rcnn_shapes.py'} <= names


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_config_neck_matches_backbone(path):
    """At the config's own size, the neck consumes exactly the backbone's outputs. Built and
    run on the meta device: only shapes are read, so the full-size backbone (ViT-L, Swin-B)
    needs no weights initialised nor arithmetic done; an op that needs values fails there."""
    cfg = _config(path)
    with torch.device('meta'):
        backbone = _build(dict(cfg.model.backbone, init_cfg=None))
        with torch.no_grad():
            feats = backbone(torch.zeros(1, 3, 64, 64))
    neck = cfg.model.get('neck')
    if neck is not None and isinstance(neck.get('in_channels'), (list, tuple)):
        assert list(neck.in_channels) == list(backbone.out_channels)
    assert all(f.is_meta for f in feats)
    assert [f.shape[1] for f in feats] == list(backbone.out_channels)


def test_maskformer_configs_are_trained_elsewhere():
    assert {i for p, i in zip(CONFIGS, CONFIG_IDS) if _is_maskformer(p)} == {
        'swin_mask2former_instance.py', 'swin_mask2former_panoptic.py',
        'vit_mask2former_panoptic.py'}


@pytest.mark.parametrize('path', [p for p, _ in TRAINABLE], ids=[i for _, i in TRAINABLE])
def test_config_trains_and_predicts(path):
    cfg = _config(path)
    _train_and_predict(_shrink(cfg.model), cfg.optim_wrapper)


@pytest.mark.parametrize('stock', STOCK)
def test_stock_mmdet_config_with_our_backbone(stock):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    cfg = Config.fromfile(_stock_path(stock))
    init_default_scope('mmdet')
    bb = cfg.model.backbone
    assert bb.type == 'SwinTransformer'
    bb.type = 'SwinBackbone'
    bb.init_cfg = None
    torch.manual_seed(0)
    model = _build(cfg.model)
    model.init_weights()
    assert type(model.backbone).__name__ == 'SwinBackbone'
    assert list(cfg.model.neck.in_channels) == list(model.backbone.out_channels)
    data = model.data_preprocessor(
        _batch(model, 'mask_head' in cfg.model.get('roi_head', {}), 80), training=True)
    model.train()
    losses = model.loss(data['inputs'], data['data_samples'])
    total = sum(v.sum() if isinstance(v, torch.Tensor) else sum(v) for v in losses.values())
    assert torch.isfinite(total)
    total.backward()
    grad = model.backbone.layers[0].blocks[0].attn.qkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_3x_config_is_amp_multiscale_crop():
    cfg = load_config(osp.join(ROOT, 'configs/swin_mask_rcnn_3x_ms_amp.py'))
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert cfg.train_cfg.max_epochs == 36
    types = [t['type'] for t in cfg.train_dataloader.dataset.pipeline]
    assert 'RandomChoice' in types
    crop = cfg.train_dataloader.dataset.pipeline[types.index('RandomChoice')].transforms[1]
    assert [t['type'] for t in crop] == ['RandomChoiceResize', 'RandomCrop',
                                         'RandomChoiceResize']


def test_retinanet_config_mirrors_mmdet():
    ours = load_config(osp.join(ROOT, 'configs/swin_retinanet.py'))
    from mmengine.config import Config
    stock = Config.fromfile(_stock_path(STOCK[0]))
    for key in ('depths', 'num_heads', 'window_size', 'drop_path_rate', 'out_indices'):
        want, got = stock.model.backbone[key], _arch(ours.model.backbone, key)
        assert _plain(got) == _plain(want), key
    assert list(ours.model.neck.in_channels) == [192, 384, 768]
    assert ours.model.neck.num_outs == stock.model.neck.num_outs == 5
    assert ours.optim_wrapper.optimizer.type == 'AdamW'
    assert ours.train_cfg.max_epochs == 12
    assert ours.train_dataloader.dataset.ann_file == stock.train_dataloader.dataset.ann_file


def _plain(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def _arch(bb, key):
    presets = dict(depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24])
    if key in bb and bb[key] is not None:
        return bb[key]
    assert bb.arch == 'tiny'
    return presets[key]


# ----------------------------------------------------------------------------- data_root
def _data_cfg(path):
    cfg = _config(path)
    if 'data_root' not in cfg:
        pytest.skip(f'{osp.relpath(path, ROOT)} has no top-level data_root')
    return cfg


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_data_root_override_reaches_everything(path, tmp_path):
    base = _data_cfg(path)
    old = base.data_root
    derived = data_root_paths(base)
    assert any(k.endswith('dataset.data_root') for k in derived)
    new = str(tmp_path / 'elsewhere') + '/'
    moved = load_config(path, {'data_root': new})
    # nothing refers to the old root any more, every derived key now sits below the new one
    assert data_root_paths(moved, old) == []
    assert set(data_root_paths(moved, new)) == set(derived)
    for stage in ('train', 'val', 'test'):
        assert moved[f'{stage}_dataloader'].dataset.data_root.rstrip('/') == new.rstrip('/')
    for key in ('val_evaluator', 'test_evaluator'):
        for evaluator in _evaluators(moved[key]):
            for field in ('ann_file', 'seg_prefix'):
                if evaluator.get(field):
                    assert evaluator[field].startswith(new), (key, field)
    # explicit options still win over the propagation
    first = 'val_evaluator' if isinstance(base.val_evaluator, dict) else 'val_evaluator.0'
    explicit = load_config(path, {'data_root': new, f'{first}.ann_file': '/x/a.json'})
    assert _evaluators(explicit.val_evaluator)[0].ann_file == '/x/a.json'


def _evaluators(node) -> list:
    """A config's val/test evaluator as a list (a config may give one dict or a list)."""
    return list(node) if isinstance(node, (list, tuple)) else [node]


def _plain_cfg(node):
    """ConfigDicts (also inside lists) as plain dicts, for comparison."""
    if isinstance(node, (list, tuple)):
        return [_plain_cfg(n) for n in node]
    return node.to_dict() if hasattr(node, 'to_dict') else node


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_missing_data_message_gives_working_override(path, tmp_path, monkeypatch):
    from mmengine.config import DictAction

    monkeypatch.chdir(tmp_path)  # relative data roots resolve to nothing here
    cfg = _data_cfg(path)
    with pytest.raises(DatasetNotFoundError) as info:
        check_data(cfg, ('train', 'val'), config_path=path)
    msg = str(info.value)
    assert f"data_root='{cfg.data_root}'" in msg
    assert 'annotations/' in msg and 'missing' in msg
    assert '--cfg-options data_root=/path/to/data/' in msg
    # the explicit override in the message, applied the way plain mmdet tools apply it
    # (merge_from_dict, no propagation), points every dataloader/evaluator to the new root
    line = next(ln for ln in msg.splitlines() if ln.strip().startswith('--cfg-options')
                and len(ln.split()) > 2)
    options = {}
    for item in shlex.split(line)[1:]:
        k, v = item.split('=', 1)
        options[k] = DictAction._parse_iterable(v)
    plain = _config(path)
    plain.merge_from_dict(options)
    propagated = load_config(path, {'data_root': '/path/to/data/'})
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader', 'val_evaluator',
                'test_evaluator'):
        assert _plain_cfg(plain[key]) == _plain_cfg(propagated[key]), key


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_pretrained_weights_can_be_added_as_each_header_says(path, tmp_path):
    """A child config, or --cfg-options, adds init_cfg=dict(type='Pretrained', ...) to the
    backbone (mmengine refuses to merge a dict into a base's ``init_cfg=None``)."""
    from mmengine.config import Config, DictAction
    ckpt = str(tmp_path / 'weights.pth')
    child = tmp_path / 'child.py'
    child.write_text(f'_base_ = [{path!r}]\nmodel = dict(backbone=dict(init_cfg=dict('
                     f'type="Pretrained", checkpoint={ckpt!r})))\n')
    # a config whose backbone already loads a checkpoint (make demo-detr's) keeps its other
    # Pretrained keys (the prefix); the path is the one given
    base = Config.fromfile(path).model.backbone.get('init_cfg') or {}
    want = dict(base, type='Pretrained', checkpoint=ckpt)
    assert Config.fromfile(str(child)).model.backbone.init_cfg == want
    cfg = Config.fromfile(path)
    parser = __import__('argparse').ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    args = parser.parse_args(['--cfg-options', 'model.backbone.init_cfg.type=Pretrained',
                              f'model.backbone.init_cfg.checkpoint={ckpt}'])
    cfg.merge_from_dict(args.cfg_options)
    assert cfg.model.backbone.init_cfg == want
