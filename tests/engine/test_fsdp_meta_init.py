"""``FSDP2Wrapper(init_device='meta')`` on 2 gloo ranks (one torchrun job,
tests/meta_init_worker.py): every rank builds the pretrained backbone on the meta device,
allocates only its shards and copies them out of the memory-mapped checkpoint, through the
layout table (a timm ViT, ``timm_vit`` layout: keys renamed, the position grid resampled).

The gathered weights equal those of the existing path (the whole model initialised on every
rank, then sharded) bit for bit, for a ``.safetensors`` and a ``.pth`` file; the randomly
initialised rest is the same for both files (the same seed) and has mmdet's RetinaHead init;
each rank holds half of the bytes; the model trains.
"""
import json
import math
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
from mmengine.model import bias_init_with_prob
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from dist_worker import make_data
from fsdp_worker import EMBED_DIMS
from helpers import REPO_ROOT, randomize_
from test_distributed import _free_port

ROOT = str(REPO_ROOT)
WORKER = osp.join(ROOT, 'tests', 'meta_init_worker.py')
WORLD_SIZE = 2
JOB_TIMEOUT_S = 300
#: the prior probability of mmdet's RetinaHead classification bias init
RETINA_PRIOR = 0.01
#: a rank's share of the bytes: 1/2, give or take the rows of odd first dims
SHARE_SLACK = 0.02
FORMATS = ('safetensors', 'pth')


def _timm_vit_checkpoints(root: str) -> dict:
    """A tiny timm ViT (the worker's backbone size, random norms too) as each format."""
    vit = randomize_(VisionTransformer(img_size=64, patch_size=16, embed_dim=EMBED_DIMS,
                                       depth=2, num_heads=2, num_classes=0))
    sd = {k: v.contiguous() for k, v in vit.state_dict().items()}
    paths = {fmt: osp.join(root, f'timm_vit.{fmt}') for fmt in FORMATS}
    save_file(sd, paths['safetensors'])
    torch.save(sd, paths['pth'])
    return dict(paths=paths, state=sd)


def test_meta_init_loads_the_shards_of_the_existing_path(tmp_path):
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    ckpt = _timm_vit_checkpoints(str(tmp_path))
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT, osp.join(ROOT, 'tests'),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD_SIZE}',
           '--nnodes=1', '--master_addr=127.0.0.1', f'--master_port={_free_port()}',
           WORKER, data, work, *[ckpt['paths'][fmt] for fmt in FORMATS]]
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]

    rest = {}
    whole = torch.load(osp.join(work, f'{FORMATS[0]}_whole.pt'), weights_only=True)
    for fmt in FORMATS:
        meta = torch.load(osp.join(work, f'{fmt}_meta.pt'), weights_only=True)
        assert whole.keys() == meta.keys()
        backbone = [k for k in whole if k.startswith('backbone.')]
        assert len(backbone) == 27, backbone
        for name in backbone:  # the checkpoint's weights, bit for bit
            assert type(meta[name]) is torch.Tensor, name
            assert torch.equal(meta[name], whole[name]), (fmt, name)
        # the converter's renames, independent of both paths
        for ours, theirs in (('blocks.1.attn.qkv.weight', 'blocks.1.attn.qkv.weight'),
                             ('blocks.0.mlp.fc2.bias', 'blocks.0.mlp.fc2.bias'),
                             ('patch_embed.proj.weight', 'patch_embed.proj.weight')):
            assert torch.equal(meta['backbone.' + ours], ckpt['state'][theirs]), ours
        rest[fmt] = {k: v for k, v in meta.items() if not k.startswith('backbone.')}
        for rank in range(WORLD_SIZE):
            res = json.load(open(osp.join(work, f'{fmt}_meta.rank{rank}.json')))
            assert res['built_on_meta'] and len(res['report']) == len(backbone)
            share = res['bytes']['local_params'] / res['bytes']['total_params']
            assert abs(share - 0.5) <= SHARE_SLACK, res['bytes']

    # the rest: initialised on every rank alike, from the seed, by the modules' own init
    first, second = (rest[fmt] for fmt in FORMATS)
    assert first.keys() == second.keys() and len(first) > 0
    for name, w in first.items():
        assert torch.equal(w, second[name]), name
        assert torch.isfinite(w).all(), name
    cls_bias = first['bbox_head.retina_cls.bias']
    assert torch.equal(cls_bias, torch.full_like(cls_bias, bias_init_with_prob(RETINA_PRIOR)))

    assert not json.load(open(osp.join(work, f'{FORMATS[0]}_whole.rank1.json')))['built_on_meta']
    losses = [json.load(open(osp.join(work, f'{FORMATS[0]}_meta.rank{r}.json')))['losses']
              for r in range(WORLD_SIZE)]
    assert all(len(rank_losses) == 1 and math.isfinite(rank_losses[0]) for rank_losses in losses)


def _rss_file() -> int:
    """Bytes of file-backed pages this process has resident (Linux)."""
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('RssFile'))


#: the tensor of the lazy-reading test: 32 MB, far above the resident-set noise
BIG = (8, 1024, 1024)


def test_read_lazily_maps_both_formats_releases_pages_refuses_unsafe(tmp_path):
    import argparse

    from vitdet_plugin.weights import CheckpointError
    from vitdet_plugin.weights.lazy import read_lazily
    sd = {'big': torch.randn(BIG), 'small': torch.arange(6.0)}
    save_file(sd, str(tmp_path / 'w.safetensors'))
    torch.save(sd, str(tmp_path / 'w.pth'))
    size = sd['big'].nbytes
    for name in ('w.safetensors', 'w.pth'):
        lazy = read_lazily(str(tmp_path / name))
        assert lazy.mapped, name
        before = _rss_file()
        for key, ref in sd.items():  # reading the values touches the file's pages
            assert torch.equal(lazy.tensors[key], ref), (name, key)
        assert _rss_file() - before >= size // 2, name
        lazy.release(lazy.tensors['big'])
        assert _rss_file() - before < size // 2, name
        assert torch.equal(lazy.tensors['big'], sd['big'])  # read again from the file
        lazy.release(torch.ones(4))  # no view of the file: left alone

    torch.save(dict(sd, args=argparse.Namespace(lr=1)), str(tmp_path / 'unsafe.pth'))
    with pytest.raises(CheckpointError, match=r"^refused to load checkpoint '.*unsafe\.pth': "
                       r'it contains Python objects that are not on the weights_only '
                       r'allow-list \(refused: argparse\.Namespace\)'):
        read_lazily(str(tmp_path / 'unsafe.pth'))


def test_meta_init_refusals_name_the_fix():
    from vitdet_plugin.engine.meta_init import check_init_device, reset_uncovered
    with pytest.raises(ValueError, match=r"^FSDP2Wrapper\(init_device='cuda'\): give 'meta' "):
        check_init_device('cuda', False)
    with pytest.raises(ValueError, match=r"^FSDP2Wrapper: init_device='meta' and "
                       r'init_on_rank0=True exclude each other'):
        check_init_device('meta', True)
    with torch.device('meta'):
        model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Module())
    model[1].rel_pos = torch.nn.Parameter(torch.zeros(3, device='meta'))
    reset_uncovered(model, ['0.weight', '0.bias'])  # a norm: its constructor's values
    assert torch.equal(model[0].weight, torch.ones(4))
    assert torch.equal(model[0].bias, torch.zeros(4))
    with pytest.raises(ValueError, match=r"^FSDP2Wrapper\(init_device='meta'\): 1\.rel_pos is not "
                       r'in the checkpoint of its part and Module cannot be reset on its own '
                       r'\(reset_parameters\); use init_on_rank0=True for this model$'):
        reset_uncovered(model, ['1.rel_pos'])


def test_7b_official_layout_stand_in_loads_through_the_meta_path(tmp_path):
    """The DINOv3 7B preset's official layout (the small-width stand-in of
    tests/models/backbones/test_dinov3_7b.py) through the meta path on one process (no
    sharding): built on the meta device, materialised from the memory-mapped file, equal to
    ``init_weights`` of the model built whole."""
    from mmdet.registry import MODELS
    from test_dinov3_7b import IMG, NAME
    from test_official_vit_layouts import TINY, dinov3_official, randn, tiny

    from vitdet_plugin.engine.meta_init import MetaInit, build_with_meta_parts
    official = {k: v for k, v in dinov3_official(tiny(NAME, IMG).state_dict()).items()
                if '.attn.qkv.bias' not in k}
    dim = TINY['embed_dim']
    official.update({'local_cls_norm.weight': randn(dim, seed=7),
                     'local_cls_norm.bias': randn(dim, seed=8)})
    path = str(tmp_path / 'dinov3_7b.pth')
    torch.save({'model': official}, path)
    cfg = dict(type='DINOv3Backbone', arch='7b', embed_dims=dim, depth=TINY['depth'],
               num_heads=TINY['num_heads'], global_attn_indexes=(0, 1),
               init_cfg=dict(type='Pretrained', checkpoint=path))
    model = build_with_meta_parts(MODELS.build, cfg)
    assert all(t.is_meta for t in model.state_dict().values())
    MetaInit(model).materialise(model, torch.device('cpu'))
    whole = MODELS.build(cfg)
    whole.init_weights()
    assert model.init_report == whole.init_report
    assert sorted(model.init_report.dropped) == ['local_cls_norm.bias', 'local_cls_norm.weight',
                                                 'mask_token', 'rope_embed.periods']
    expected = whole.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, w in model.state_dict().items():
        assert torch.equal(w, expected[name]), name


def test_swin_checkpoint_without_output_norms_resets_them_on_the_meta_path(tmp_path):
    """A Swin checkpoint without the detection output norms (a classification one): on the
    meta path those LayerNorms get their constructor's values (``reset_parameters``), as the
    model built whole keeps them; everything else equals ``init_weights``."""
    from mmdet.registry import MODELS

    from vitdet_plugin.engine.meta_init import MetaInit, build_with_meta_parts
    arch = dict(type='SwinBackbone', arch=dict(embed_dims=16, depths=(1, 1), num_heads=(1, 1)),
                out_indices=(0, 1))
    source = randomize_(MODELS.build(arch))
    sd = {k: v for k, v in source.state_dict().items() if not k.startswith('norm')}
    path = str(tmp_path / 'swin.safetensors')
    save_file(sd, path)
    cfg = dict(arch, init_cfg=dict(type='Pretrained', checkpoint=path))
    model = build_with_meta_parts(MODELS.build, cfg)
    MetaInit(model).materialise(model, torch.device('cpu'))
    whole = MODELS.build(cfg)
    whole.init_weights()
    norms = sorted(model.init_report.missing_allowed)
    assert norms == sorted(whole.init_report.missing_allowed) and norms, norms
    expected = whole.state_dict()
    for name, w in model.state_dict().items():
        assert torch.equal(w, expected[name]), name
