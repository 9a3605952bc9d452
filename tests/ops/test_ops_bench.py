"""tools/dev/op_parity.py (the op-parity module: extension swap, detector comparison) and
tools/dev/bench/ops.py (``tools/benchmark.py --model ops``):
the extension swap reaches every mmcv op, the rows alternate ours and the reference, the
command line, and both tools' message where compiled mmcv is absent."""
import argparse
import os.path as osp
import sys
import types
from typing import Any, Dict, List

import pytest
import torch
from mmengine.structures import InstanceData
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
FIX = 'make env MMCV=compiled'
#: mmcv.ops modules whose extension calls the detectors make.
OP_MODULES = ('mmcv.ops.nms', 'mmcv.ops.roi_align', 'mmcv.ops.focal_loss',
              'mmcv.ops.multi_scale_deform_attn', 'mmcv.ops.deform_conv',
              'mmcv.ops.modulated_deform_conv', 'mmcv.ops.bbox', 'mmcv.ops.roi_pool')


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The ``dev.bench`` package as ``python tools/benchmark.py`` sees it (tools/ on the path)."""
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))
    import dev.bench.ops
    return dev.bench


def _cli() -> types.ModuleType:
    """tools/benchmark.py, the command line, as a module (the ``bench`` fixture puts tools/ on
    the path)."""
    import benchmark
    return benchmark


@pytest.fixture
def parity(bench: types.ModuleType) -> types.ModuleType:
    """``dev.op_parity`` (tools/ on the path, by the ``bench`` fixture)."""
    import dev.op_parity
    return dev.op_parity


class FakeExt:
    """An extension whose ``nms`` records its calls and keeps the first box."""

    def __init__(self) -> None:
        self.calls: List[str] = []

    def nms(self, boxes: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls.append('nms')
        return torch.zeros(1, dtype=torch.long)


def _boxes() -> Dict[str, torch.Tensor]:
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [50., 50., 60., 60.]])
    return dict(boxes=boxes, scores=torch.tensor([0.9, 0.8, 0.7]))


def test_use_ext_swaps_every_op_module_and_restores(parity: Any) -> None:
    import mmcv.ops
    holders = {m.__name__: m for m in parity.ext_holders()}
    assert set(OP_MODULES) <= set(holders)
    before = {name: vars(m)['ext_module'] for name, m in holders.items()}
    fake = FakeExt()
    with parity.use_ext(fake):
        assert all(vars(m)['ext_module'] is fake for m in holders.values())
        dets, keep = mmcv.ops.nms(**_boxes(), iou_threshold=0.5)
    assert fake.calls == ['nms'] and keep.tolist() == [0] and dets.shape == (1, 5)
    assert {name: vars(m)['ext_module'] for name, m in holders.items()} == before
    with pytest.raises(RuntimeError, match='inside'), parity.use_ext(fake):
        raise RuntimeError('inside')
    assert {name: vars(m)['ext_module'] for name, m in holders.items()} == before


def test_recording_ext_forwards_to_ours(parity: Any) -> None:
    import mmcv.ops
    recording = parity.RecordingExt(parity.ours_ext())
    with parity.use_ext(recording):
        _, keep = mmcv.ops.nms(**_boxes(), iou_threshold=0.5)
    assert keep.tolist() == [0, 2] and recording.calls == {'nms': 1}


def test_ext_dispatch_routes_cpu_paths_and_restores(parity: Any) -> None:
    import mmcv.ops.multi_scale_deform_attn as msda
    from mmdet.models.losses import FocalLoss
    pytorch_msda, forward = msda.multi_scale_deformable_attn_pytorch, FocalLoss.forward
    fake = FakeExt()
    calls: List[str] = []
    fake.sigmoid_focal_loss_forward = lambda *a, **k: calls.append('fwd')
    with parity.use_ext(fake), parity.ext_dispatch():
        assert msda.multi_scale_deformable_attn_pytorch is not pytorch_msda
        FocalLoss()(torch.zeros(4, 3), torch.tensor([0, 1, 2, 3]))
    assert calls == ['fwd']  # mmcv's op: on CPU mmdet would use its PyTorch loss
    assert msda.multi_scale_deformable_attn_pytorch is pytorch_msda
    assert FocalLoss.forward is forward


def test_compiled_ext_tells_ours_from_compiled(parity: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    parity.ext_holders()  # mmcv.ops imported
    monkeypatch.setitem(sys.modules, 'mmcv._ext', parity.ours_ext())
    assert parity.compiled_ext() is None
    compiled = types.ModuleType('mmcv._ext')
    monkeypatch.setitem(sys.modules, 'mmcv._ext', compiled)
    assert parity.compiled_ext() is compiled


def test_model_ops_arguments(bench: types.ModuleType, monkeypatch: pytest.MonkeyPatch,
                             tmp_path: Any) -> None:
    cli = _cli()
    args = cli.resolve(cli.build_parser(), ['--model', 'ops', '--repeats', '2', '--warmup',
                                            '0', '--json', str(tmp_path / 'o.json')])
    assert (args.model, args.repeats, args.warmup, args.device) == ('ops', 2, 0, 'cpu')
    assert cli.resolve(cli.build_parser(), ['--model', 'ops', '--device', 'cuda']).repeats == 10
    seen: List[argparse.Namespace] = []
    monkeypatch.setattr(cli, 'run_ops', lambda a: seen.append(a) or [])
    cli.main(['--model', 'ops', '--repeats', '3'])
    assert len(seen) == 1 and seen[0].repeats == 3
    with pytest.raises(SystemExit):
        cli.resolve(cli.build_parser(), ['--model', 'ops', '--repeats', '0'])


def _args(bench: types.ModuleType, repeats: int, warmup: int,
          device: str = 'cpu') -> argparse.Namespace:
    cli = _cli()
    return cli.resolve(cli.build_parser(), [
        '--model', 'ops', '--repeats', str(repeats), '--warmup', str(warmup), '--device', device])


def test_rows_alternate_ours_and_reference(bench: types.ModuleType) -> None:
    ops, order = bench.ops, []
    ours, compiled = FakeExt(), FakeExt()

    def setup(device: str) -> Any:
        def call() -> List[torch.Tensor]:
            order.append('ours' if vars(sys.modules['mmcv.ops.nms'])['ext_module'] is ours
                         else 'ref')
            return [torch.ones(2)]
        return ops.Pair(call)
    case = ops.Case('fake nms', ops.GROUP_OPS, ('nms', ), setup)
    row = ops.measure(case, _args(bench, 3, 1), ours, compiled)
    assert order == ['ours', 'ref'] * 4  # one warm-up round, then 3 timed
    assert len(row['times']['ours']) == len(row['times']['ref']) == 3
    assert row['diff'] == 0.0 and row['ratio'] > 0 and row['reference'] == ops.COMPILED
    assert ops.reference_kind(ops.Case('m', ops.GROUP_MSDA, ops.MSDA_OPS, setup),
                              'cpu') == ops.PYTORCH
    assert ops.reference_kind(ops.Case('m', ops.GROUP_MSDA, ops.MSDA_OPS, setup),
                              'cuda') == ops.COMPILED


def test_slow_rows_get_fewer_repeats(bench: types.ModuleType) -> None:
    ops = bench.ops
    args = _args(bench, 20, 1)
    assert ops.row_repeats(args, 0.01) == 20
    assert ops.row_repeats(args, ops.ROW_SECONDS / 5) == 5
    assert ops.row_repeats(args, ops.ROW_SECONDS * 10) == ops.MIN_ROW_REPEATS
    assert ops.row_repeats(_args(bench, 2, 1), ops.ROW_SECONDS * 10) == 2
    assert ops.row_repeats(_args(bench, 20, 1, device='cuda'), ops.ROW_SECONDS) == 10


def test_benchmark_without_compiled_mmcv_says_so(bench: types.ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    ops = bench.ops
    monkeypatch.setattr(ops, 'compiled_ext', lambda: None)
    monkeypatch.setattr(ops, 'cases', lambda: [ops.box_case('nms', 50)])
    rows = _cli().main(['--model', 'ops', '--repeats', '1', '--warmup', '0'])
    out = capsys.readouterr().out
    assert 'nms 50 boxes' in out and ops.COMPILED_MISSING in out and FIX in out
    assert 'ref' not in rows[0] and rows[0]['ours'] > 0


def test_parity_without_compiled_mmcv_names_the_fix(parity: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parity, 'compiled_ext', lambda: None)
    with pytest.raises(SystemExit, match=FIX):
        parity.main(['--detectors', 'retinanet'])
    assert parity.build_parser().parse_args([]).detectors == list(parity.DETECTORS)


def test_parity_comparisons(parity: Any) -> None:
    box = torch.tensor([[0., 0., 10., 10.], [5., 5., 20., 20.]])
    masks = torch.zeros(2, 8, 8, dtype=torch.bool)
    masks[:, :4, :4] = True
    ref = InstanceData(bboxes=box, scores=torch.tensor([0.9, 0.5]), labels=torch.tensor([1, 2]),
                       masks=masks)
    moved = masks.clone()
    moved[1, :4, :2] = False
    ours = InstanceData(bboxes=box + 0.5, scores=torch.tensor([0.9, 0.4]),
                        labels=torch.tensor([1, 3]), masks=moved)
    out = parity.compare_preds([ours], [ref])
    assert out['dets'] == [(2, 2)] and out['box'] == 0.5 and out['label_agree'] == 0.5
    assert out['box_any'] == float('inf')  # box 1: no box of label 3 in ref
    assert out['score'] == pytest.approx(0.1) and out['mask_iou_min'] == 0.5
    assert out['mask_agree'] == pytest.approx(1 - 8 / 128)
    tied = dict(scores=torch.tensor([0.7, 0.7]), labels=torch.tensor([1, 1]),
                masks=torch.zeros(2, 8, 8, dtype=torch.bool))
    same = parity.compare_preds([InstanceData(bboxes=box.flip(0), **tied)],
                                [InstanceData(bboxes=box, **tied)])  # a tie in another order
    assert same['box'] == 10 and same['box_any'] == 0 and same['mask_iou_min'] == 1.0
    grads = {'a': torch.tensor([1.0, -2.0]), 'b': torch.tensor([1e-9, 0.0])}
    g = parity.compare_grads({'a': torch.tensor([1.0, -2.2]), 'b': torch.tensor([3e-9, 0.0])},
                             grads)
    assert g['worst'] == 'a' and g['max_rel'] == pytest.approx(0.1)
    losses = parity.compare_losses({'loss': torch.tensor(1.5)}, {'loss': torch.tensor(1.0)})
    assert losses == [dict(term='loss', ours=1.5, ref=1.0, abs=0.5, rel=0.5)]


def test_shared_error_measures(parity: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One op-parity module: the benchmark rows and the GPU op checks measure with its errors."""
    a, b = torch.tensor([1.0, 2.0, -4.0]), torch.tensor([1.0, 2.5, -4.0])
    assert parity.rel_err(a, b) == pytest.approx(0.5 / 4.0)
    assert parity.rel_l2(a, b) == pytest.approx(0.5 / float(b.norm()))
    assert parity.rel_err(torch.zeros(0), torch.zeros(0)) == 0.0
    assert parity.rel_err(a, torch.zeros(3)) > 1e30  # a zero reference: no division by zero
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools', 'dev'))
    import dev.bench.ops
    import gpu_check_kit.op_checks
    assert gpu_check_kit.op_checks.rel_err is dev.bench.ops.rel_err is parity.rel_err
    assert gpu_check_kit.op_checks.rel_l2 is parity.rel_l2
    assert dev.bench.ops.rel_diff([a], [b]) == parity.rel_err(a, b)
