"""Checkpoint loading through mmengine (``load_from``, ``--resume``, ``load_checkpoint``):
weights_only by default, an explicit per-file trust list, and only unpickling / format errors
reported as "cannot read"."""
import argparse
import os
import pickle

import pytest
import torch
from mmengine.runner.checkpoint import load_checkpoint

import vitdet_plugin  # noqa: F401
from vitdet_plugin.compat import safe_load_from_local
from vitdet_plugin.weights.checkpoint_io import TRUST_ENV, CheckpointError


def _namespace_checkpoint(path) -> torch.nn.Linear:
    """A training checkpoint as many scripts write it: weights plus an argparse Namespace."""
    model = torch.nn.Linear(2, 3)
    torch.save(dict(state_dict=model.state_dict(), args=argparse.Namespace(lr=0.1)), path)
    return model


def test_untrusted_checkpoint_with_objects_is_refused_naming_object_and_trust(tmp_path,
                                                                               monkeypatch):
    path = str(tmp_path / 'train.pth')
    _namespace_checkpoint(path)
    monkeypatch.delenv(TRUST_ENV, raising=False)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(torch.nn.Linear(2, 3), path)
    msg = str(info.value)
    assert msg.startswith(f"refused to load checkpoint '{path}': it contains Python objects "
                          'that are not on the weights_only allow-list (refused: '
                          'argparse.Namespace); unpickling it could run arbitrary code, so ')
    assert msg.endswith(f'nothing was loaded or executed. If you trust this file, list it in '
                        f'the environment variable VITDET_TRUSTED_CHECKPOINTS (e.g. '
                        f"VITDET_TRUSTED_CHECKPOINTS={path}; several files separated by "
                        f"'{os.pathsep}') and it is read with full unpickling; or re-save it "
                        'as tensors and plain containers.')


def test_checkpoint_listed_as_trusted_loads_and_only_that_one(tmp_path, monkeypatch):
    trusted, other = str(tmp_path / 'trusted.pth'), str(tmp_path / 'other.pth')
    ref = _namespace_checkpoint(trusted)
    _namespace_checkpoint(other)
    monkeypatch.setenv(TRUST_ENV, os.pathsep.join([str(tmp_path / 'unrelated.pth'), trusted]))
    model = torch.nn.Linear(2, 3)
    ckpt = load_checkpoint(model, trusted)
    assert ckpt['args'] == argparse.Namespace(lr=0.1)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    with pytest.raises(CheckpointError, match=r'refused: argparse\.Namespace\)'):
        load_checkpoint(torch.nn.Linear(2, 3), other)
    # a directory or a prefix does not trust the files in it
    monkeypatch.setenv(TRUST_ENV, str(tmp_path))
    with pytest.raises(CheckpointError, match=r'refused: argparse\.Namespace\)'):
        load_checkpoint(torch.nn.Linear(2, 3), trusted)


def test_trusted_path_matches_after_tilde_expansion(tmp_path, monkeypatch):
    monkeypatch.setenv('HOME', str(tmp_path))
    path = str(tmp_path / 'ckpt.pth')
    _namespace_checkpoint(path)
    monkeypatch.setenv(TRUST_ENV, '~/ckpt.pth')
    assert safe_load_from_local(path)['args'].lr == 0.1


@pytest.mark.parametrize('error', [
    torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'),
    RuntimeError('Attempting to deserialize object on CUDA device 3 but '
                 'torch.cuda.device_count() is 1'),
], ids=['oom', 'device'])
def test_errors_other_than_format_errors_are_not_relabelled(tmp_path, monkeypatch, error):
    path = str(tmp_path / 'ok.pth')
    torch.save({'state_dict': {}}, path)

    def failing_load(*args, **kwargs):
        raise error
    monkeypatch.setattr(torch, 'load', failing_load)
    with pytest.raises(type(error)) as info:
        safe_load_from_local(path)
    assert info.value is error


@pytest.mark.parametrize('content, error', [
    (b'', r'EOFError: '),
    (b'plain text, not a checkpoint', r'UnpicklingError: Unsupported operand 112'),
    (b'hello, not a checkpoint', r'KeyError: '),
    (pickle.dumps({'w': 1}, protocol=2), r'RuntimeError: Invalid magic number'),
    ('truncated', r'RuntimeError: PytorchStreamReader failed reading zip archive'),
], ids=['empty', 'text', 'text-get-opcode', 'plain-pickle', 'truncated'])
def test_a_file_that_is_no_checkpoint_is_named(tmp_path, content, error):
    path = str(tmp_path / 'bad.pth')
    if content == 'truncated':
        torch.save({'w': torch.ones(100)}, path)
        with open(path, 'rb') as f:
            content = f.read()[:200]
    with open(path, 'wb') as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=rf"^cannot read '{path}' as a checkpoint \({error}"
                                              r'.*\): the file is truncated or not written by '
                                              r'torch\.save \(expected a \.pth/\.pt file written '
                                              r'by torch\.save, a \.safetensors file or a '
                                              r'detectron2 \.pkl\); save or download it again\. '
                                              r'Nothing in it was executed\.$'):
        safe_load_from_local(path)
