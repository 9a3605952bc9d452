"""``FSDP2Runner`` resumed on another number of ranks with gradient accumulation (one process,
the shapes data, the tiny RetinaNet of tests/dist_worker.py): the epoch checkpoint of a run with
half the iterations per epoch (a batch of 2 for 2 ranks x 1 image) resumed with a batch of 1
(one rank) continues at its epoch x this run's iterations per epoch (mmengine keeps the
writing run's count: the iterations, ``max_iters`` and the accumulation windows out of step with
the epochs), at the start of an accumulation window, and ends where an uninterrupted one-rank
run ends; a run whose checkpoints fall inside windows is warned at its start."""
import logging
import os.path as osp

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import vitdet_plugin  # noqa: F401

#: images of the data set; accumulated iterations per optimizer step
IMAGES, ACCUMULATE = 8, 2
#: mmengine's warning of a resume inside an accumulation window
MMENGINE_WARNING = 'Resumed iteration number is not divisible'


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _runner(data_root: str, work_dir: str, batch: int, epochs: int,
            accumulate: int = ACCUMULATE, **kw) -> Runner:
    cfg = tiny_cfg(data_root, work_dir, name=f'b{batch}e{epochs}', runner_type='FSDP2Runner',
                   **kw)
    cfg['train_dataloader'].update(batch_size=batch,
                                   sampler=dict(type='DefaultSampler', shuffle=False))
    cfg['train_cfg'] = dict(type='EpochBasedTrainLoop', max_epochs=epochs, val_interval=99)
    cfg['optim_wrapper']['accumulative_counts'] = accumulate
    cfg['param_scheduler'] = []
    cfg['default_hooks']['checkpoint'] = dict(type='AtomicCheckpointHook', interval=1)
    cfg['log_processor'] = dict(by_epoch=True)
    torch.set_num_threads(1)
    return RUNNERS.build(Config(cfg))


def _train(runner: Runner) -> list:
    handler = _Warnings()
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        runner.train()
    finally:
        logger.removeHandler(handler)
    return handler.messages


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('shapes')), num_images=IMAGES)


def test_resume_on_fewer_ranks_starts_whole_accumulation_windows(data_root, tmp_path):
    first = _runner(data_root, str(tmp_path / 'two'), batch=2, epochs=1)
    assert not [m for m in _train(first) if 'accumul' in m]
    assert type(first).__name__ == 'FSDP2Runner'
    assert first.iter == IMAGES // 2
    checkpoint = osp.join(str(tmp_path / 'two'), 'epoch_1.pth')
    resumed = _runner(data_root, str(tmp_path / 'one'), batch=1, epochs=2, resume=True,
                      load_from=checkpoint)
    warnings = _train(resumed)
    assert not [m for m in warnings if MMENGINE_WARNING in m], warnings
    assert resumed.epoch == 2 and resumed.iter == 2 * IMAGES  # as a one-rank run's 2 epochs
    assert resumed.optim_wrapper._inner_count == 2 * IMAGES


def test_epochs_that_are_not_whole_windows_are_warned_at_the_start(data_root, tmp_path):
    runner = _runner(data_root, str(tmp_path / 'odd'), batch=4, epochs=1, accumulate=4)
    warnings = _train(runner)
    assert any('an epoch is 2 iterations, not a multiple of optim_wrapper.accumulative_counts=4'
               in m for m in warnings), warnings
