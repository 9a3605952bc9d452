"""NonFiniteCheckHook guards the optimizer step: a NaN loss or gradient never reaches the
weights or the optimizer state, and a guarded iteration synchronises with the device once."""
import glob
import os.path as osp
from typing import Dict, List

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper
from mmengine.runner import Runner

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine.nonfinite import NonFiniteCheckHook, NonFiniteError

NAN_AT = 2          # the iteration (1-based) whose loss is poisoned
MAX_ITERS = 3


class _PoisonLoss(Hook):
    """Multiplies every loss of iteration ``at`` by NaN (a forward hook on the detector that
    runs before the guard's, as a NaN produced inside the loss computation would)."""
    priority = 'VERY_HIGH'

    def __init__(self, at: int) -> None:
        self.at = at
        self.iter = 0

    def before_train(self, runner) -> None:
        runner.model.register_forward_hook(self._poison)

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self.iter = runner.iter + 1

    def _poison(self, module, args, output):
        if self.iter != self.at or not isinstance(output, dict):
            return output
        nan = float('nan')
        return {k: ([t * nan for t in v] if isinstance(v, list) else v * nan)
                if 'loss' in k else v for k, v in output.items()}


class _Snapshots(Hook):
    """Weights and AdamW moments after every iteration."""
    priority = 'LOWEST'

    def __init__(self) -> None:
        self.weights: Dict[int, Dict[str, torch.Tensor]] = {}
        self.moments: Dict[int, List[torch.Tensor]] = {}

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.weights[runner.iter + 1] = {k: v.detach().clone()
                                         for k, v in runner.model.state_dict().items()}
        state = runner.optim_wrapper.optimizer.state
        self.moments[runner.iter + 1] = [state[p]['exp_avg'].clone() for p in state]


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('shapes')))


def _runner(data_root, work_dir, action, *extra_hooks):
    torch.set_num_threads(1)
    cfg = tiny_cfg(data_root, work_dir, max_iters=MAX_ITERS, ckpt_interval=100,
                   name=f'nan-{action}', custom_hooks=list(extra_hooks))
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks']
                           if not (isinstance(h, dict) and h['type'] == 'NonFiniteCheckHook')]
    cfg['custom_hooks'].append(dict(type='NonFiniteCheckHook', action=action))
    return Runner(**cfg)


def _assert_all_finite(state: Dict[str, torch.Tensor]) -> None:
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, f'non-finite weights: {bad}'


def test_nan_loss_with_log_action_skips_the_step(data_root, tmp_path):
    snaps = _Snapshots()
    runner = _runner(data_root, str(tmp_path), 'log', _PoisonLoss(NAN_AT), snaps)
    runner.train()
    assert runner.iter == MAX_ITERS
    guard = next(h for h in runner.hooks if isinstance(h, NonFiniteCheckHook))
    assert guard.skipped_steps == 1
    for it in range(1, MAX_ITERS + 1):
        _assert_all_finite(snaps.weights[it])
    # the poisoned step changed nothing: weights and AdamW moments as after iteration 1
    for key, value in snaps.weights[NAN_AT - 1].items():
        assert torch.equal(snaps.weights[NAN_AT][key], value), key
    for a, b in zip(snaps.moments[NAN_AT], snaps.moments[NAN_AT - 1]):
        assert torch.equal(a, b)
    # and training went on afterwards
    assert any(not torch.equal(snaps.weights[MAX_ITERS][k], v)
               for k, v in snaps.weights[NAN_AT].items() if v.is_floating_point())
    text = ''.join(open(p).read() for p in glob.glob(osp.join(str(tmp_path), '*', '*.log')))
    assert (f'non-finite values during training at iteration {NAN_AT}: non-finite losses '
            'loss_cls=nan, loss_bbox=nan, loss=nan.') in text
    assert 'The optimizer step is skipped (weights and optimizer state unchanged).' in text


def test_nan_loss_with_raise_action_stops_before_the_step(data_root, tmp_path):
    snaps = _Snapshots()
    runner = _runner(data_root, str(tmp_path), 'raise', _PoisonLoss(NAN_AT), snaps)
    with pytest.raises(NonFiniteError, match=rf'at iteration {NAN_AT}: non-finite losses '
                       r'loss_cls=nan, loss_bbox=nan, loss=nan\. Common causes: .* The '
                       r'optimizer step was not taken\.$'):
        runner.train()
    assert runner.iter == NAN_AT - 1
    after = runner.model.state_dict()
    _assert_all_finite(after)
    for key, value in snaps.weights[NAN_AT - 1].items():
        assert torch.equal(after[key], value), key


class _NanGrad(Hook):
    """Makes the gradient of one parameter NaN in iteration ``at`` (the loss stays finite)."""
    priority = 'VERY_HIGH'
    PARAM = 'bbox_head.retina_reg.bias'

    def __init__(self, at: int) -> None:
        self.at = at

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if runner.iter + 1 == self.at:
            p = runner.model.get_parameter(self.PARAM)
            handle = p.register_hook(lambda g: (handle.remove(), g * float('nan'))[1])


def test_nan_gradient_with_finite_loss_is_named(data_root, tmp_path):
    runner = _runner(data_root, str(tmp_path), 'raise', _NanGrad(NAN_AT))
    with pytest.raises(NonFiniteError, match=rf'at iteration {NAN_AT}: non-finite gradients '
                       rf'in 1 parameters \({_NanGrad.PARAM}\) with finite losses\.'):
        runner.train()
    _assert_all_finite(runner.model.state_dict())


# ----------------------------------------------------------------------------- cost
class _Tiny(torch.nn.Module):
    """A model with the attributes the hook watches and mmengine's loss-dict forward."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        self.neck = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.head(self.neck(self.backbone(x)))
        return dict(loss_a=y.square().mean(), loss_b=[y.abs().mean(), y.mean().abs()])


class _SyncCounter:
    """Counts host reads of tensor values (item, tolist, bool, float, int)."""
    METHODS = ('item', 'tolist', '__bool__', '__float__', '__int__')

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(real))

    def _counting(self, real):
        def method(t, *args, **kwargs):
            self.calls += 1
            return real(t, *args, **kwargs)
        return method


def test_a_guarded_iteration_reads_the_device_once(monkeypatch):
    """Forward outputs, losses and gradients are gathered into one tensor read once per step
    (the old hook read every output and loss separately: ~10 syncs per GPU iteration)."""
    from types import SimpleNamespace
    model = _Tiny()
    # SGD: Adam's single-tensor step reads its step counter with .item() itself
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    runner = SimpleNamespace(model=model, optim_wrapper=wrapper, iter=0)
    hook = NonFiniteCheckHook()
    hook.before_train(runner)
    x = torch.randn(3, 4)
    counter = _SyncCounter(monkeypatch)
    hook.before_train_iter(runner, 0)
    losses = model(x)
    loss = losses['loss_a'] + sum(losses['loss_b'])
    wrapper.update_params(loss)
    hook.after_train_iter(runner, 0, outputs=dict(loss=loss.detach()))
    assert counter.calls == 1
    monkeypatch.undo()
    hook.after_train(runner)
