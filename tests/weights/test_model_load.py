"""mmengine's whole-model loading (``load_checkpoint``, ``load_from``, a module's Pretrained
``init_cfg``) refuses a checkpoint with a tensor of another shape than the model's, naming the
tensors, instead of skipping them with a log line; keys either side lacks stay mmengine's to
log. RF-DETR's files and messages: tests/weights/test_rfdetr_user_path.py."""
import re

import pytest
import torch
from mmengine.model import BaseModule
from mmengine.runner.checkpoint import load_checkpoint as mmengine_load_checkpoint
from torch import nn

import vitdet_plugin  # noqa: F401  (routes mmengine's loading through the check)
from vitdet_plugin.weights import CheckpointError


class Tiny(BaseModule):
    """A two-layer model; ``classes`` sizes its last layer."""

    def __init__(self, classes: int, init_cfg=None) -> None:
        super().__init__(init_cfg)
        self.body = nn.Linear(4, 8)
        self.cls = nn.Linear(8, classes)


def test_a_tensor_of_another_shape_is_refused_naming_it(tmp_path):
    torch.save({'state_dict': Tiny(3).state_dict()}, tmp_path / 'tiny3.pth')
    want = ('2 tensors of the checkpoint do not fit Tiny (cls.weight: (3, 8) in the checkpoint, '
            '(5, 8) in the model; cls.bias: (3,) in the checkpoint, (5,) in the model): load it '
            'into the model it was saved from (its config: sizes and num_classes), or load its '
            "backbone alone (the backbone's init_cfg=dict(type='Pretrained', checkpoint=...))")
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        mmengine_load_checkpoint(Tiny(5), str(tmp_path / 'tiny3.pth'))
    model = Tiny(5, init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'tiny3.pth')))
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        model.init_weights()


def test_keys_either_side_lacks_still_load_the_rest(tmp_path):
    source = Tiny(3)
    state = {k: v for k, v in source.state_dict().items() if k.startswith('body.')}
    torch.save({'state_dict': {**state, 'extra.weight': torch.zeros(1)}}, tmp_path / 'part.pth')
    model = Tiny(3)
    mmengine_load_checkpoint(model, str(tmp_path / 'part.pth'))
    assert torch.equal(model.body.weight, source.body.weight)
