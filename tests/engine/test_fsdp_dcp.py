"""DCP checkpoint directories under FSDP2Runner (``checkpoint_format``, vitdet_plugin.engine.dcp
and fsdp_runner) on 2 gloo ranks: one torchrun job of tests/fsdp_dcp_worker.py (3 sharded
runs), one of 1 rank, checked against each other and against the single-file form.

Each rank writes its own shard file (no gather); a resume from a DCP directory continues
bit-identically; a directory written by 2 ranks resumes on 2 ranks, on 1 rank and on one
process without a wrapper with the same weights and optimizer state; the conversion tool
turns it into exactly the file the single-file form writes, and back; ``max_keep_ckpts``
removes old directories and ``last_checkpoint`` names the newest complete one.
"""
import json
import os
import os.path as osp

import pytest
import torch
from fsdp_worker import register_recorder, vit_cfg
from test_dcp import _flat
from test_fsdp import ROOT, WORLD_SIZE, torchrun as torchrun_fsdp
from dist_worker import make_data
from helpers import run_tool

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine.dcp import PARTIAL_SUFFIX, dcp_to_file, file_to_dcp, \
    is_dcp_checkpoint, read_dcp
from vitdet_plugin.engine.fsdp_runner import (ADAMW_STATE_COPIES, DCP_MIN_STATE_BYTES,
                                              check_fsdp_config, checkpoint_state_bytes)
from fsdp_dcp_worker import ITERS, MAX_KEEP

WORKER = 'fsdp_dcp_worker.py'
#: the checkpoint entries holding tensors of the training state
STATE_ENTRIES = ('state_dict', 'ema_state_dict', 'optimizer', 'param_schedulers')


def torchrun(nproc: int, *args: str):
    return torchrun_fsdp(*args, worker=osp.join(ROOT, 'tests', WORKER), nproc=nproc)


@pytest.fixture(scope='module')
def dcp_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fsdp_dcp')
    data = make_data(str(tmp / 'data'))
    work = str(tmp / 'work')
    os.makedirs(osp.join(work, 'resume'))
    with open(osp.join(work, 'resume', 'last_checkpoint'), 'w') as f:  # auto-resume from it
        f.write(osp.join(work, 'fsdp', 'iter_2'))
    job = torchrun(WORLD_SIZE, 'train', data, work)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    ranks = [json.load(open(osp.join(work, f'rank{r}.json'))) for r in range(WORLD_SIZE)]
    return data, work, ranks


def test_dcp_checkpoints_resume_bit_identically_keep_the_newest(dcp_job):
    data, work, ranks = dcp_job
    run = osp.join(work, 'fsdp')
    # max_keep_ckpts: the two newest directories, complete, one shard file per rank
    names = os.listdir(run)
    assert sorted(n for n in names if n.startswith('iter_')) == [
        f'iter_{i}' for i in range(ITERS - MAX_KEEP + 1, ITERS + 1)]
    assert not [n for n in names if n.endswith(('.tmp', PARTIAL_SUFFIX))], names
    assert open(osp.join(run, 'last_checkpoint')).read() == osp.join(run, f'iter_{ITERS}')
    newest = osp.join(run, f'iter_{ITERS}')
    assert is_dcp_checkpoint(newest) and not osp.exists(newest + PARTIAL_SUFFIX)
    shards = sorted(f for f in os.listdir(newest) if f.endswith('.distcp'))
    assert shards == [f'__{r}_0.distcp' for r in range(WORLD_SIZE)]
    sizes = [osp.getsize(osp.join(newest, f)) for f in shards]
    assert min(sizes) > 0.3 * sum(sizes), sizes  # each rank wrote its half, nothing gathered

    for res in ranks:
        assert res['fsdp']['format'] == 'dcp' and res['file']['format'] == 'file'
        # auto-resumed at iteration 2: the third iteration's loss, bit-identical
        assert res['resume']['losses'] == res['fsdp']['losses'][2:]
        assert res['file']['losses'] == res['fsdp']['losses']
    straight = read_dcp(newest)
    resumed = read_dcp(osp.join(work, 'resume', f'iter_{ITERS}'))
    for key in STATE_ENTRIES:
        assert _flat(resumed[key]) == _flat(straight[key]), key
    assert resumed['meta']['iter'] == ITERS


def _check_loaded(work: str, world: int) -> None:
    """What the ``load`` run of ``world`` ranks holds after resuming from the newest DCP
    directory equals the directory's content."""
    saved = read_dcp(osp.join(work, 'fsdp', f'iter_{ITERS}'))
    # the checkpoint holds the averaged weights in state_dict (EMAHook's swap)
    trained = {k[len('module.'):]: v for k, v in saved['ema_state_dict'].items()
               if k.startswith('module.')}
    averaged = {'module.' + k: v for k, v in saved['state_dict'].items()}
    loaded = torch.load(osp.join(work, f'loaded{world}.pt'), weights_only=False)
    assert loaded['iter'] == ITERS
    assert _flat(_plain(loaded['model'])) == _flat(trained)
    assert _flat({k: v for k, v in loaded['ema'].items() if k != 'steps'}) == _flat(averaged)
    assert int(loaded['ema']['steps']) == int(saved['ema_state_dict']['steps']) == ITERS
    assert _flat(loaded['optimizer']['state']) == _flat(saved['optimizer']['state'])
    assert loaded['lr'] == [g['lr'] for g in saved['optimizer']['param_group_settings']]
    assert loaded['schedulers'] == saved['param_schedulers']


def test_dcp_of_two_ranks_resumes_on_two_ranks_and_loads_without_wrapper(dcp_job, tmp_path):
    data, work, _ = dcp_job
    _check_loaded(work, WORLD_SIZE)
    # one process, no wrapper (FSDP2Runner, launcher 'none'): load_from reads it whole
    from mmengine.config import Config
    from mmengine.registry import RUNNERS
    register_recorder()
    cfg = vit_cfg(data, str(tmp_path / 'one'), ITERS, 1, 1, 'none', experiment_name='one')
    cfg['runner_type'] = 'FSDP2Runner'
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks'] if h['type'] != 'EMAHook']
    runner = RUNNERS.build(Config(cfg))
    newest = osp.join(work, 'fsdp', f'iter_{ITERS}')
    runner.load_checkpoint(newest, strict=True)
    assert _flat(_plain(runner.model.state_dict())) == _flat(_plain(read_dcp(newest)[
        'state_dict']))


@pytest.mark.slow
def test_dcp_of_two_ranks_resumes_on_one_rank(dcp_job):
    """A world size of 1 (torchrun, FSDP2 over one rank): DCP reshards the 2 ranks' files."""
    data, work, _ = dcp_job
    job = torchrun(1, 'load', data, work, osp.join(work, 'fsdp', f'iter_{ITERS}'))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    _check_loaded(work, 1)


def _plain(node):
    """A dict of any kind as a plain dict (torch returns one or the other)."""
    return dict(node) if isinstance(node, dict) else node


def test_runner_dcp_converts_to_the_single_file_form_and_back(dcp_job, tmp_path):
    _, work, _ = dcp_job
    newest = osp.join(work, 'fsdp', f'iter_{ITERS}')
    as_file, back = str(tmp_path / 'iter_3.pth'), str(tmp_path / 'iter_3_dcp')
    run = run_tool('dcp_convert.py', [newest, as_file])
    assert run.returncode == 0, run.stderr
    converted = torch.load(as_file, weights_only=False)
    # what the single-file form wrote at the same iteration of the same run
    written = torch.load(osp.join(work, 'file', f'iter_{ITERS}.pth'), weights_only=False)
    assert converted.keys() == written.keys()
    for key in STATE_ENTRIES:  # (a dict in one, an OrderedDict in the other: torch's choice)
        assert _flat(_plain(converted[key])) == _flat(_plain(written[key])), key
    file_to_dcp(as_file, back)
    assert _flat(read_dcp(back)) == _flat(converted)
    again = str(tmp_path / 'again.pth')
    dcp_to_file(back, again)
    assert _flat(torch.load(again, weights_only=False)) == _flat(converted)


def test_checkpoint_format_rule_and_refusal():
    vit_l = torch.nn.Linear(1024, 1024 * 300, device='meta')  # 1.2 GiB of fp32 weights
    frozen = torch.nn.Linear(1024, 1024 * 60, device='meta').requires_grad_(False)
    size = 4 * (1024 * 300 * 1025)
    assert checkpoint_state_bytes(vit_l) == (1 + ADAMW_STATE_COPIES) * size
    assert checkpoint_state_bytes(frozen) == 4 * 1024 * 60 * 1025 < DCP_MIN_STATE_BYTES
    check_fsdp_config(dict(runner_type='FSDP2Runner', checkpoint_format='dcp'))
    with pytest.raises(ValueError, match=r"^checkpoint_format='sharded' is not one of \['auto', "
                       r"'dcp', 'file'\]; set 'auto' \(DCP directories above 1 GiB of model \+ "
                       r"AdamW state\), 'dcp' or 'file'$"):
        check_fsdp_config(dict(runner_type='FSDP2Runner', checkpoint_format='sharded'))


def test_train_resume_accepts_a_dcp_directory(tmp_path):
    from helpers import load_tool
    from vitdet_plugin.engine.dcp import save_dcp
    tool = load_tool('train.py')
    ckpt = str(tmp_path / 'iter_4')
    save_dcp(dict(meta=dict(iter=4), state_dict={'w': torch.ones(2)}), ckpt)
    fsdp = osp.join(ROOT, 'configs', 'dinov3_l_cascade_mask_rcnn_fsdp.py')
    cfg = tool.build_cfg(tool.parse_args([fsdp, '--resume', ckpt]))
    assert (cfg.resume, cfg.load_from, cfg.checkpoint_format) == (True, ckpt, 'auto')
    ddp = osp.join(ROOT, 'configs', 'vit_mask_rcnn.py')
    with pytest.raises(SystemExit, match=r"^error: --resume .*iter_4: a DCP checkpoint directory "
                       r"is read by runner_type='FSDP2Runner'; convert it for this config with "
                       r'python tools/dcp_convert.py .*iter_4 FILE\.pth$'):
        tool.build_cfg(tool.parse_args([ddp, '--resume', ckpt]))
    with pytest.raises(SystemExit, match=r'^error: --resume .*missing: no such checkpoint file '
                       r'or DCP checkpoint directory \(a directory holding \.metadata\)$'):
        tool.build_cfg(tool.parse_args([fsdp, '--resume', str(tmp_path / 'missing')]))
