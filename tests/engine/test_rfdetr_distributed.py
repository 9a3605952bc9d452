"""RF-DETR N (configs/rfdetr/rfdetr_nano.py, shrunk as tests/configs/test_configs.py shrinks it)
trains a step on 2 gloo ranks with DDP (mmengine's MMDistributedDataParallel: every parameter
gets a gradient, or DDP waits for it) and with FSDP2 (rfdetr_nano_fsdp.py as shipped: FSDP2Runner,
every ViT block sharded, bf16 parameters with fp32 reductions): one torchrun job of
tests/fsdp_worker.py's ``configs`` mode."""
import json
import math
import os
import os.path as osp

import pytest

from dist_worker import make_data
from helpers import REPO_ROOT
from test_fsdp import JOB_TIMEOUT_S, torchrun

ROOT = str(REPO_ROOT)
#: config -> the wrapper its shrunk step must run under
WRAPPERS = {'configs/rfdetr/rfdetr_nano.py': 'MMDistributedDataParallel',
            'configs/rfdetr/rfdetr_nano_fsdp.py': 'FSDP2Wrapper'}


@pytest.mark.slow
def test_rfdetr_nano_trains_a_step_on_two_ranks_with_ddp_and_fsdp2(tmp_path):
    data = make_data(str(tmp_path / 'data'))
    work = str(tmp_path / 'work')
    os.makedirs(work)
    job = torchrun('configs', data, work, *[osp.join(ROOT, p) for p in WRAPPERS],
                   timeout=2 * JOB_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-6000:]
    for path, wrapper in WRAPPERS.items():
        res = json.load(open(osp.join(work, osp.basename(path)[:-3] + '.json')))
        assert res['wrapper'] == wrapper and res['iter'] == 1, res
        assert len(res['losses']) == 1 and math.isfinite(res['losses'][0]), res
