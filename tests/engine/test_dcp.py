"""DCP checkpoint directories <-> the ordinary mmengine file (vitdet_plugin.engine.dcp,
tools/dcp_convert.py): an mmengine checkpoint (written by mmengine's ``save_checkpoint``: model,
AdamW state of torch's optimizer, message hub, scheduler, meta) round-trips file -> DCP -> file
unchanged, and the DCP directory is read by torch's own DCP reader."""
import io
import os
import os.path as osp

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_tool
from mmengine.logging import MessageHub
from mmengine.runner.checkpoint import save_checkpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vitdet_plugin.engine.dcp import SKELETON_KEY, dcp_to_file, file_to_dcp, is_dcp_checkpoint
from vitdet_plugin.weights import CheckpointError


def _flat(node):
    """Nested containers as comparable values: tensors and arrays -> (dtype, shape, bytes),
    containers and objects (mmengine's HistoryBuffer) -> (type, contents)."""
    if isinstance(node, torch.Tensor):
        return ('tensor', str(node.dtype), tuple(node.shape), node.numpy().tobytes())
    if isinstance(node, np.ndarray):
        return ('ndarray', str(node.dtype), node.shape, node.tobytes())
    if isinstance(node, dict):
        return (type(node).__name__, {k: _flat(v) for k, v in node.items()})
    if isinstance(node, (list, tuple)):
        return (type(node).__name__, [_flat(v) for v in node])
    if hasattr(node, '__dict__'):
        return (type(node).__name__, _flat(vars(node)))
    return node


@pytest.fixture
def checkpoint(tmp_path) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1])
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    hub = MessageHub.get_instance('test_dcp')
    hub.update_scalar('train/loss', 0.5)
    path = str(tmp_path / 'iter_2.pth')
    save_checkpoint(dict(meta=dict(iter=2, seed=0, dataset_meta=dict(classes=('a', 'b'))),
                         state_dict=model.state_dict(), optimizer=optimizer.state_dict(),
                         message_hub=hub.state_dict(), param_schedulers=[scheduler.state_dict()]),
                    path)
    return path


def test_file_to_dcp_to_file_round_trips(checkpoint, tmp_path):
    dcp_dir, back = str(tmp_path / 'iter_2'), str(tmp_path / 'back.pth')
    file_to_dcp(checkpoint, dcp_dir)
    assert is_dcp_checkpoint(dcp_dir) and not is_dcp_checkpoint(checkpoint)
    assert sorted(os.listdir(dcp_dir)) == ['.metadata', '__0_0.distcp']
    # torch's reader sees the tensors under their nested keys
    meta = FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    assert isinstance(meta['state_dict.0.weight'], TensorStorageMetadata)
    assert tuple(meta['state_dict.0.weight'].size) == (3, 4)
    dcp_to_file(dcp_dir, back)
    original = torch.load(checkpoint, weights_only=False)
    assert _flat(torch.load(back, weights_only=False)) == _flat(original)
    assert not any(f.endswith('.partial') for f in os.listdir(tmp_path))

    # the command: both directions, by what the source is
    assert run_tool('dcp_convert.py', [back, str(tmp_path / 'again')]).returncode == 0
    run = run_tool('dcp_convert.py', [str(tmp_path / 'again'), str(tmp_path / 'again.pth')])
    assert (run.returncode, run.stdout.split(':')[0]) == (0, 'DCP -> file')
    assert _flat(torch.load(str(tmp_path / 'again.pth'), weights_only=False)) == _flat(original)


def test_conversion_refuses_wrong_sources_and_existing_targets(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r'^.*not_dcp is not a DCP checkpoint directory \(no '
                       r'\.metadata in it\); give the directory a sharded run saved'):
        os.makedirs(tmp_path / 'not_dcp')
        dcp_to_file(str(tmp_path / 'not_dcp'), str(tmp_path / 'x.pth'))
    with pytest.raises(ValueError, match=r'missing\.pth is not a checkpoint file; give a \.pth '
                       r'file \(a DCP directory converts the other way\)$'):
        file_to_dcp(str(tmp_path / 'missing.pth'), str(tmp_path / 'd'))
    with pytest.raises(FileExistsError, match=r'iter_2\.pth exists; give a new path or remove '
                       r'it first$'):
        file_to_dcp(checkpoint, checkpoint)
    assert run_tool('dcp_convert.py', [checkpoint, checkpoint]).returncode == 1
    assert osp.isfile(checkpoint)


class Payload:
    """An object no allow-list holds: unpickling it could run code."""


def test_conversion_reads_weights_only_both_ways(tmp_path):
    """A checkpoint with an object off the weights_only allow-list is refused, naming it, in
    both directions (a .pth file, and the pickled entry of a DCP directory): nothing is
    unpickled unless the file is listed in VITDET_TRUSTED_CHECKPOINTS."""
    tampered = str(tmp_path / 'tampered.pth')
    torch.save({'meta': Payload(), 'state_dict': {'w': torch.ones(2)}}, tampered)
    refused = r"refused to load checkpoint .*: it contains Python objects .*refused: .*Payload\)"
    with pytest.raises(CheckpointError, match=refused):
        file_to_dcp(tampered, str(tmp_path / 'd'))
    entry = io.BytesIO()
    torch.save({'meta': Payload()}, entry)
    dcp_dir = str(tmp_path / 'tampered_dcp')
    dcp.save({'w': torch.ones(2), SKELETON_KEY: entry}, checkpoint_id=dcp_dir)
    with pytest.raises(CheckpointError, match=refused):
        dcp_to_file(dcp_dir, str(tmp_path / 'x.pth'))
    assert run_tool('dcp_convert.py', [dcp_dir, str(tmp_path / 'x.pth')]).returncode == 1
    assert not osp.exists(tmp_path / 'x.pth') and not osp.exists(tmp_path / 'd')
