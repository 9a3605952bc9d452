"""tools/benchmark.py (its code in tools/dev/bench/): per-device plans, the CUDA timing path chosen
without a GPU, option resolution for both models, memory measures, table lines, and
``--end-to-end`` (an exported detector graph in onnxruntime vs PyTorch eval): its refusals, and
its rows on a tiny exported SdpaDETR (slow: the export takes 1-3 min of CPU)."""
import os.path as osp
import re
import warnings

import pytest
import torch
from helpers import REPO_ROOT, randomize_

ROOT = str(REPO_ROOT)


@pytest.fixture
def bench(monkeypatch):
    """The ``dev.bench`` package as ``python tools/benchmark.py`` sees it (tools/ on the path)."""
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))
    import dev.bench.plan
    import dev.bench.rows
    return dev.bench


@pytest.fixture
def cli(bench):
    """tools/benchmark.py, the command line, as a module (tools/ on the path)."""
    import benchmark
    return benchmark


def test_cuda_plan_without_a_gpu(bench):
    plan = bench.plan.plan_for('cuda', 'swin')
    assert (plan.synchronize, plan.memory, plan.sizes, plan.train_size, plan.batch,
            plan.dtypes, plan.repeats, plan.min_repeats, plan.processes, plan.clocks) == (
        True, 'peak_cuda', ((800, 1216), ), (800, 1216), 2, ('fp32', 'bf16'), 10, 10, 1,
        ('wall', ))
    assert plan.warmup >= 1 and plan.train_repeats(10) == 10
    vit = bench.plan.plan_for('cuda:1', 'vit')
    assert (vit.device, vit.sizes, vit.train_size) == ('cuda:1', ((1024, 1024), ), (1024, 1024))


def test_cpu_plan_keeps_the_readme_measurement(bench):
    plan = bench.plan.plan_for('cpu', 'swin')
    assert (plan.synchronize, plan.memory, plan.sizes, plan.train_size, plan.batch,
            plan.dtypes, plan.repeats, plan.processes) == (
        False, 'saved_activations', ((224, 224), (800, 1216), (1024, 1024)), (512, 512), 1,
        ('fp32', ), 5, 3)
    assert plan.train_repeats(5) == 2
    assert bench.plan.plan_for('cpu', 'vit').sizes == ((1024, 1024), )
    with pytest.raises(ValueError, match="--device 'tpu': the benchmark runs on cpu, cuda"):
        bench.plan.plan_for('tpu', 'swin')


def test_cuda_timer_synchronizes_around_the_call(bench, monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: events.append(device))
    timer = bench.plan.make_timer(bench.plan.plan_for('cuda:0', 'swin'), 'wall')
    seconds = timer(lambda: events.append('call'))
    assert events == ['cuda:0', 'call', 'cuda:0'] and seconds >= 0
    with pytest.raises(ValueError, match='--clock cpu does not measure work on cuda'):
        bench.plan.make_timer(bench.plan.plan_for('cuda', 'vit'), 'cpu')
    cpu = bench.plan.make_timer(bench.plan.plan_for('cpu', 'vit'), 'cpu')
    events.clear()
    cpu(lambda: None)
    assert events == [] and cpu.clock is __import__('time').process_time


def test_cuda_memory_is_the_peak_of_a_training_step(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench.plan, 'peak_cuda_bytes', lambda fn, device: seen.append(
        (fn, device)) or 123)
    train, forward = (lambda: None), (lambda: None)
    plan = bench.plan.plan_for('cuda', 'swin')
    assert bench.plan.memory_bytes(plan, forward, train, []) == 123
    assert seen == [(train, 'cuda')]


def test_cpu_memory_counts_saved_activations(bench):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    plan = bench.plan.plan_for('cpu', 'swin')
    # x @ w saves x (128 bytes) and w (a parameter, excluded); relu saves its output (128)
    got = bench.plan.memory_bytes(plan, lambda: torch.relu(x @ w), lambda: None, [w])
    assert got == 2 * 4 * 8 * 4


def test_bf16_autocast_context_per_device(bench):
    assert bench.plan.autocast_for('cuda', 'fp32')().__class__.__name__ == 'nullcontext'
    ctx = bench.plan.autocast_for('cpu', 'bf16')()
    assert (ctx.device, ctx.fast_dtype) == ('cpu', torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # "CUDA is not available" on a CPU-only machine
        ctx = bench.plan.autocast_for('cuda:0', 'bf16')()
    assert ctx.device == 'cuda'


def test_options_resolve_per_device_and_model(bench, cli):
    args = cli.resolve(cli.build_parser(), ['--device', 'cuda'])
    assert (args.arch, args.sizes, args.train_size, args.batch, args.dtypes, args.repeats,
            args.warmup, args.processes, args.timer.synchronize) == (
        'tiny', [(800, 1216)], (800, 1216), 2, ['fp32', 'bf16'], 10, 3, 1, True)
    args = cli.resolve(cli.build_parser(), ['--model', 'vit', '--device', 'cuda', '--with-cp',
                                            '--sizes', '512', '--dtypes', 'bf16'])
    assert args.arch == 'base' and [s.text() for s in cli.row_specs(args)] == [
        '512x512:nocp:bf16', '512x512:cp:bf16']
    args = cli.resolve(cli.build_parser(), ['--model', 'vit', '--clock', 'cpu', '--batch', '3',
                                            '--train-size', '64x96', '--warmup', '0'])
    assert (args.sizes, args.train_size, args.batch, args.warmup, args.processes,
            args.dtypes, args.timer.clock.__name__) == (
        [(1024, 1024)], (64, 96), 3, 0, 3, ['fp32'], 'process_time')
    spec = cli.row_specs(args)[0]
    assert bench.rows.RowSpec.parse(spec.text()) == spec


@pytest.mark.parametrize('argv, message', [
    (['--device', 'cuda', '--repeats', '9'], '--repeats must be at least 10, got 9'),
    (['--repeats', '0'], '--repeats must be at least 1, got 0'),
    (['--batch', '0'], '--batch must be at least 1, got 0'),
    (['--sizes', '12y'], "size '12y' is not N or HxW"),
    (['--device', 'cuda', '--clock', 'cpu'], '--clock cpu does not measure work on cuda'),
])
def test_bad_options_are_argument_errors(cli, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.resolve(cli.build_parser(), argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_mmdet_swin_spec_read_off_the_weights(bench):
    from dev.bench.models import mmdet_swin_spec
    table = 'attn.w_msa.relative_position_bias_table'
    sd = {'patch_embed.projection.weight': torch.zeros(32, 3, 4, 4)}
    for stage, (depth, heads) in enumerate([(2, 2), (3, 4)]):
        for b in range(depth):
            sd[f'stages.{stage}.blocks.{b}.{table}'] = torch.zeros(13 * 13, heads)
    assert mmdet_swin_spec(sd) == dict(embed_dims=32, depths=(2, 3), num_heads=(2, 4),
                                       window_size=7)


def test_row_lines_are_ratios_per_reference(bench):
    row = {'size': '800x1216', 'with_cp': False, 'dtype': 'bf16',
           'fwd': {'ours': [1.0, 3.0, 2.0], 'mmdet': [4.0, 4.0, 4.0], 'timm': [2.0, 2.0]},
           'mem MB': {'ours': 50.0, 'mmdet': 100.0, 'timm': 200.0}}
    assert bench.rows.format_row(row) == [
        '  800x1216    bf16 | fwd: ours 2 (mmdet 4, timm 2) ratio /mmdet 0.50x, /timm 1.00x'
        ' | mem MB: ours 50 (mmdet 100, timm 200) ratio /mmdet 0.50x, /timm 0.25x']
    cp = dict(row, with_cp=True, dtype='fp32', **{'mem MB': {'ours': 10.0, 'mmdet': 20.0}})
    assert bench.rows.with_cp_line(cp, row) == (
        '              | mem MB: ours with_cp 10 / mmdet without 100 = 0.10x')


def test_vit_row_runs_with_every_option(tmp_path, cli):
    """ViT-B vs timm samvit through the same code as Swin: the CPU clock, batch, warm-up and
    JSON options reach it, and the weights really are shared (the parity check passes)."""
    import json
    rows = cli.main(['--model', 'vit', '--sizes', '64', '--train-size', '32x48',
                     '--repeats', '1', '--warmup', '0', '--batch', '1', '--clock', 'cpu',
                     '--same-process', '--json', str(tmp_path / 'vit.json')])
    (row, ) = rows
    assert set(row['fwd']) == {'ours', 'timm'} and row['parity'] < 0.1  # exact at 1024 only
    assert (row['size'], row['train_size'], len(row['fwd']['ours'])) == ('64x64', '32x48', 1)
    saved = json.loads((tmp_path / 'vit.json').read_text())
    assert (saved['model'], saved['arch'], saved['rows'][0]['size']) == ('vit', 'base', '64x64')


def test_benchmark_script_has_no_path_edits():
    bench = osp.join(ROOT, 'tools', 'dev', 'bench')
    for path in [osp.join(ROOT, 'tools', 'benchmark.py'), osp.join(ROOT, 'tools', 'dev',
                                                                   'op_parity.py')] + [
            osp.join(bench, f) for f in ('compiled.py', 'models.py', 'ops.py', 'plan.py',
                                         'rows.py', 'end_to_end_latency.py')]:
        text = open(path).read()
        assert not re.search(r'sys\.path\.(insert|append)', text), path
    assert not osp.exists(osp.join(ROOT, 'tools', 'benchmark_vit.py'))


@pytest.mark.parametrize('model', ['dinov2', 'dinov3', 'eva02'])
def test_vit_family_row_compares_timm_and_windowed(model, cli):
    """ours (all blocks global) vs timm with the same weights (parity enforced), and ours
    windowed beside it, in one row."""
    rows = cli.main(['--model', model, '--arch', 'small', '--sizes', '64', '--train-size', '64',
                     '--repeats', '1', '--warmup', '0', '--clock', 'cpu', '--same-process'])
    (row, ) = rows
    assert set(row['fwd']) == set(row['fwd+bwd']) == {'ours', 'timm', 'windowed'}
    assert row['parity'] <= 1e-5


# ----------------------------------------------------------------------- --end-to-end
RETINA_DEMO = osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py')


def _refusal(cli, capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.resolve(cli.build_parser(), argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_end_to_end_refuses_missing_files_and_other_devices(cli, capsys, tmp_path):
    ckpt, graph = tmp_path / 'model.pth', tmp_path / 'det.onnx'
    ckpt.write_bytes(b'')
    missing = str(tmp_path / 'nope.pth')
    assert _refusal(cli, capsys, ['--end-to-end', RETINA_DEMO, missing, str(graph)]) == (
        f"tools/benchmark.py: error: --end-to-end: the checkpoint '{missing}' does not exist")
    assert _refusal(cli, capsys, ['--end-to-end', RETINA_DEMO, str(ckpt), str(graph)]) == (
        f"tools/benchmark.py: error: --end-to-end: the graph '{graph}' does not exist")
    assert _refusal(cli, capsys, ['--end-to-end', RETINA_DEMO, str(ckpt), str(graph),
                                  '--device', 'cuda']) == (
        'tools/benchmark.py: error: --end-to-end measures on the CPU only, got --device cuda')


def _graph(path, metadata: bool) -> str:
    """A one-node graph saved by onnx itself: ``image`` in, one output; with the end-to-end
    metadata key or without it (what ``--part backbone`` writes: maps out, no metadata)."""
    import onnx
    from onnx import TensorProto, helper
    image = helper.make_tensor_value_info('image', TensorProto.FLOAT, ['B', 3, 'H', 'W'])
    feat = helper.make_tensor_value_info('feat_0', TensorProto.FLOAT, ['B', 3, 'H', 'W'])
    model = helper.make_model(helper.make_graph(
        [helper.make_node('Relu', ['image'], ['feat_0'])], 'backbone', [image], [feat]))
    if metadata:
        entry = model.metadata_props.add()
        entry.key, entry.value = 'vitdet_plugin.deploy', '{}'
    onnx.save(model, str(path))
    return str(path)


def test_end_to_end_refuses_a_graph_without_the_detector_metadata(cli, capsys, tmp_path):
    """Refused before any model is built, naming the fix."""
    path = _graph(tmp_path / 'backbone.onnx', metadata=False)
    ckpt = tmp_path / 'model.pth'
    ckpt.write_bytes(b'')
    assert _refusal(cli, capsys, ['--end-to-end', RETINA_DEMO, str(ckpt), path]) == (
        f"tools/benchmark.py: error: --end-to-end: {path} is not an end-to-end detector graph "
        "(no 'vitdet_plugin.deploy' metadata; inputs ['image']); export one with "
        'tools/export_onnx.py CONFIG CKPT --out MODEL.onnx --part detector')


def test_end_to_end_options_resolve_to_the_demo_sizes(cli, tmp_path):
    graph = _graph(tmp_path / 'det.onnx', metadata=True)
    ckpt = tmp_path / 'model.pth'
    ckpt.write_bytes(b'')
    args = cli.resolve(cli.build_parser(), ['--end-to-end', RETINA_DEMO, str(ckpt), graph])
    assert (args.sizes, args.repeats) == ([(192, 192), (800, 1216)], 5)
    args = cli.resolve(cli.build_parser(), ['--end-to-end', RETINA_DEMO, str(ckpt), graph,
                                            '--sizes', '64x96', '--repeats', '2'])
    assert (args.sizes, args.repeats) == ([(64, 96)], 2)


def test_end_to_end_row_line(bench):
    from dev.bench.end_to_end_latency import format_row
    row = dict(size='800x1216', onnxruntime=[3.0, 1.0, 2.0], torch=[4.0, 8.0, 5.0], ratio=0.4,
               file_mib=11.74, parity_ok=False)
    assert format_row(row) == '| 800x1216 | 2.000 | 5.000 | 0.40x | 11.7 | FAILED |'


def test_end_to_end_failed_parity_is_named_under_the_table(bench):
    from dev.bench.end_to_end_latency import parity_warning
    ok = dict(size='192x192', parity_ok=True, detections=3, torch_detections=3)
    stale = dict(size='800x1216', parity_ok=False, detections=20, torch_detections=0)
    assert parity_warning([ok]) is None
    assert parity_warning([ok, stale]) == (
        "warning: onnxruntime differs from the checkpoint's predict at 800x1216 (20 vs 0 "
        'detections): the graph was probably exported from other weights (or another '
        "--cfg-options); its times are not this checkpoint's; export one with "
        'tools/export_onnx.py CONFIG CKPT --out MODEL.onnx --part detector')


#: A tiny SdpaDETR of the DETR demo (tests/deploy/test_export_detector.py's shrunk config).
TINY_DETR = """_base_ = [{base!r}]
model = dict(backbone=dict(depths=[1, 1, 1]),
             bbox_head=dict(embed_dims=32, num_heads=2, ffn_dims=64, num_decoder_layers=1,
                            num_queries=20),
             test_cfg=dict(max_per_img=30))
"""


@pytest.mark.slow  # the export: 1-3 min of CPU (the refusals above are the default suite's)
def test_end_to_end_rows_on_a_tiny_exported_detr(cli, tmp_path):
    """The rows of a real end-to-end graph: the parity call passes, the seconds are the
    repeats, the ratio is theirs; a graph of another config (max_per_img) is refused."""
    import json
    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.deploy.end_to_end import (EndToEndDetector, add_metadata,
                                                 export_end_to_end, pipeline_meta)
    from vitdet_plugin.deploy.onnx_export import build_model
    config = tmp_path / 'tiny_detr.py'
    config.write_text(TINY_DETR.format(base=osp.join(ROOT, 'configs', 'demo',
                                                        'swin_detr_shapes.py')))
    cfg, model = build_model(str(config))
    randomize_(model)  # spread-out scores: a ranking to compare
    module = EndToEndDetector(model)
    graph, ckpt = str(tmp_path / 'det.onnx'), str(tmp_path / 'det.pth')
    export_end_to_end(module, graph)
    add_metadata(graph, pipeline_meta(cfg, module))
    torch.save(dict(state_dict=model.state_dict()), ckpt)
    rows = cli.main(['--end-to-end', str(config), ckpt, graph, '--sizes', '64x96', '75x117',
                     '--repeats', '2', '--json', str(tmp_path / 'e2e.json')])
    assert [r['size'] for r in rows] == ['64x96', '75x117']
    for row in rows:
        assert row['parity_ok'] and row['detections'] > 0, row
        assert len(row['onnxruntime']) == len(row['torch']) == 2
        assert row['ratio'] == pytest.approx(sum(row['onnxruntime']) / sum(row['torch']))
        assert row['file_mib'] == osp.getsize(graph) / 2**20
    assert json.loads((tmp_path / 'e2e.json').read_text())['rows'][1]['size'] == '75x117'
    from dev.bench.end_to_end_latency import load
    with pytest.raises(ValueError, match=re.escape(
            f"--end-to-end: {graph} was not exported from {config}: its metadata differs in "
            "['max_per_img']")):
        load(str(config), ckpt, graph, {'model.test_cfg.max_per_img': 10})
