"""``tools/benchmark.py --dfine-latency [dfine_n | deimv2_n | deimv2_s | CONFIG]``: a D-FINE /
DEIMv2 detector, ours against transformers' ``DFineForObjectDetection`` /
``Deimv2ForObjectDetection`` of the same size and weights, CPU, batch 1, 640x640, fp32, one
process: PyTorch eager and onnxruntime, as ratios (ours / transformers', < 1: ours is faster).

Weights: transformers' model is built at our config's sizes (:func:`reference_config`), seeded,
saved with ``save_pretrained`` and loaded into ours through the layout table
(``init_cfg=dict(type='Pretrained', checkpoint=FOLDER)``, strict). The sizes: ``dfine_n`` is
``configs/dfine/dfine_n.py``; ``deimv2_n`` (HGNetV2 B0, DEIMv2's decoder) and ``deimv2_s``
(``DINOv3STABackbone`` S, decoder 192 wide, 4 layers) are D-FINE N's config changed to
DEIMv2's shapes (:data:`PRESETS`); any other value is a D-FINE / DEIMv2 config file.

Engines, each on the same random uint8 BGR image:

* ours eager: mmdet's data preprocessor + ``predict`` (top ``max_per_img`` over queries x
  classes); transformers' eager: its normalisation, forward and
  ``post_process_object_detection`` (the same top-k);
* ours onnxruntime: the end-to-end graph (``tools/export_onnx.py --part detector``; uint8 ->
  top-k detections, dynamic size); transformers' onnxruntime: its model in a uint8 -> top-k
  wrapper (:class:`ReferenceEndToEnd`) exported by the same torch exporter and opset at the
  fixed size (or, where that fails, the TorchScript exporter; where both fail the row says why
  and reports eager only).

Median wall seconds of ``repeats`` interleaved runs (every engine sees the same machine load)
after ``warmup`` untimed ones. Before timing the top scores of both sides are compared (max abs
difference, eager and onnxruntime): above :data:`SCORE_TOLERANCE` the run stops, as the two
would be different models.
"""
import copy
import inspect
import logging
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

#: The timed image side (D-FINE's and DEIMv2's test size).
SIZE = 640
#: Largest top-score difference of the two sides, and of their boxes as a fraction of the
#: side (the export check's tolerances).
SCORE_TOLERANCE = 1e-4
BOX_TOLERANCE = 1e-3
#: ImageNet mean / std in 0-255 pixels (DEIMv2 over DINOv3); HGNetV2 models take RGB / 255.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
#: The repository's configs.
CONFIGS = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'configs')
#: D-FINE N, the base of every preset.
DFINE_N = os.path.join(CONFIGS, 'dfine', 'dfine_n.py')
#: DEIMv2 N: D-FINE N's backbone and widths, DEIMv2's encoder fusion and decoder.
DEIMV2_N: Dict[str, Any] = dict(
    neck=dict(fuse_op='sum', csp_type='csp2'),
    bbox_head=dict(style='deimv2', class_loss='mal', dense_one_to_one=True))
#: DEIMv2 S: the DINOv3 ViT-Tiny + adapter, a 192-wide encoder and a 4-layer decoder (the
#: shapes of the official deimv2_dinov3_s_coco.yml model). The final norm on every tap: the
#: original S has none, transformers' always norms the last tap; with it on all three both
#: compute one function (two LayerNorms more than S).
DEIMV2_S: Dict[str, Any] = dict(
    data_preprocessor=dict(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
    backbone=dict(_delete_=True, type='DINOv3STABackbone', arch='S', final_norm=True),
    neck=dict(in_channels=(192,) * 3, in_strides=(8, 16, 32), hidden_dim=192, ffn_dim=512,
              encoder_levels=(2,), expansion=0.34, depth_mult=0.67, fuse_op='sum',
              version='deim', csp_type='csp2', input_proj=False),
    bbox_head=dict(in_channels=(192,) * 3, embed_dims=192, ffn_dims=512, num_layers=4,
                   num_points=(3, 6, 3), style='deimv2', class_loss='mal',
                   dense_one_to_one=True))
#: Named sizes: (config, changes merged into its ``model``).
PRESETS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    'dfine_n': (DFINE_N, {}), 'deimv2_n': (DFINE_N, DEIMV2_N), 'deimv2_s': (DFINE_N, DEIMV2_S)}
#: Spread of the perturbed weights: biases and norm shifts, norm scales around 1.
PERTURBATION = 0.1
#: Kept as built: transformers' decoder constants (the bins' ``up`` / ``reg_scale``, the
#: points' scale) and the DINOv3 LayerScale of 1 (DEIMv2's distilled ViTs have none).
CONSTANTS = ('up', 'reg_scale', 'num_points_scale', 'lambda1')
#: ONNX tensor types (``TensorProto``).
ONNX_INT32, ONNX_BOOL = 6, 9
MIB = 2**20
SEED = 0


def model_config(name: str) -> Any:
    """Our detector's model config of a preset name or a config file."""
    from mmengine.config import Config

    from vitdet_plugin.config import load_config

    path, changes = PRESETS.get(name, (name, {}))
    if not os.path.isfile(path):
        raise ValueError(f'--dfine-latency {name!r} is neither a preset {sorted(PRESETS)} nor '
                         'a config file; give one of them')
    cfg = load_config(path)
    cfg.merge_from_dict(dict(model=changes))
    return Config(dict(model=cfg.model)).model  # applies the changes' _delete_


def _out_indices(indices: List[int]) -> Dict[str, Any]:
    """A transformers backbone config's ``out_indices`` keyword (its stages, 0 the stem)."""
    return dict(out_indices=indices)


def _hgnetv2_config(backbone: Any) -> Any:
    from transformers import HGNetV2Config

    from vitdet_plugin.models.backbones.hgnetv2 import HGNetV2Arch

    arch = HGNetV2Arch.resolve(backbone['arch'])
    return HGNetV2Config(
        stem_channels=list(arch.stem_channels), stage_in_channels=list(arch.in_channels),
        stage_mid_channels=list(arch.mid_channels), stage_out_channels=list(arch.out_channels),
        stage_num_blocks=list(arch.num_blocks), stage_numb_of_layers=list(arch.num_layers),
        stage_downsample=list(arch.downsample), stage_light_block=list(arch.light_block),
        stage_kernel_size=list(arch.kernel_size), hidden_sizes=list(arch.out_channels),
        depths=list(arch.num_blocks), use_learnable_affine_block=backbone.get('use_lab', False),
        **_out_indices([i + 1 for i in backbone['out_indices']]))  # transformers: 0 is the stem


def _dinov3_config(backbone: Any) -> Tuple[Any, int]:
    """transformers' DINOv3 ViT of a ``DINOv3STABackbone`` preset, and its adapter width."""
    from transformers import DINOv3ViTConfig

    from vitdet_plugin.models.backbones.dinov3_sta import STA_PRESETS

    preset = STA_PRESETS[backbone['arch']]
    vit = preset['vit']
    if vit.get('layer_scale') is not None or vit.get('num_reg_tokens', 0):
        raise ValueError(f"--dfine-latency: DINOv3STABackbone arch {backbone['arch']!r} is not "
                         "a distilled ViT (S / M); use arch='S' or 'M'")
    width = vit['embed_dims']
    return DINOv3ViTConfig(
        hidden_size=width, num_attention_heads=vit['num_heads'],
        num_hidden_layers=vit['depth'], intermediate_size=4 * width, num_register_tokens=0,
        layer_norm_eps=vit['norm_eps'],
        apply_layernorm=backbone.get('final_norm', preset['final_norm']),
        **_out_indices([t + 1 for t in preset['taps']])), preset['sta_channels']


def _defaults(module: Callable[..., object]) -> Dict[str, Any]:
    """The keyword defaults of ``module``'s constructor (what a config leaves out)."""
    return {k: p.default for k, p in inspect.signature(module).parameters.items()
            if p.default is not inspect.Parameter.empty}


def reference_config(model: Any) -> Any:
    """transformers' ``DFineConfig`` / ``Deimv2Config`` of the same sizes as our model
    config."""
    from transformers import DFineConfig, Deimv2Config

    from vitdet_plugin.models.heads.dfine_head import DFineHead
    from vitdet_plugin.models.necks.hybrid_encoder import HybridEncoder

    backbone = model['backbone']
    neck = {**_defaults(HybridEncoder), **model['neck']}
    head = {**_defaults(DFineHead), **model['bbox_head']}
    points = head['num_points']
    common = dict(
        num_labels=head['num_classes'], encoder_in_channels=list(neck['in_channels']),
        feat_strides=list(neck['in_strides']), encoder_hidden_dim=neck['hidden_dim'],
        encoder_ffn_dim=neck['ffn_dim'], encoder_attention_heads=neck['num_heads'],
        encode_proj_layers=list(neck['encoder_levels']),
        hidden_expansion=neck['expansion'], depth_mult=neck['depth_mult'],
        d_model=head['embed_dims'], decoder_in_channels=list(head['in_channels']),
        num_feature_levels=len(head['in_channels']), decoder_ffn_dim=head['ffn_dims'],
        decoder_layers=head['num_layers'], decoder_attention_heads=head['num_heads'],
        decoder_n_points=points if isinstance(points, int) else list(points),
        num_queries=head['num_queries'], reg_scale=head['reg_scale'],
        num_denoising=head['num_denoising'])
    if head['style'] == 'dfine':
        return DFineConfig(backbone_config=_hgnetv2_config(backbone), **common)
    if backbone['type'] == 'DINOv3STABackbone':
        vit, sta = _dinov3_config(backbone)
        return Deimv2Config(backbone_config=vit, spatial_tuning_adapter_inplanes=sta,
                            encoder_fuse_op=neck['fuse_op'],
                            encoder_has_trailing_conv=neck['version'] != 'deim', **common)
    return Deimv2Config(backbone_config=_hgnetv2_config(backbone),
                        encoder_fuse_op=neck['fuse_op'], **common)


def perturb_(model: nn.Module, seed: int = SEED) -> nn.Module:
    """Every saved floating tensor random but the decoder's constants (a fresh model's class
    biases and zero-initialised heads would give every query the same scores, and a score check
    that cannot tell two models apart): weights at ``1 / sqrt(fan_in)``, norm scales and
    running variances around 1, the rest around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or name.rsplit('.', 1)[-1] in CONSTANTS:
                continue
            noise = torch.randn(t.shape, generator=g)
            if t.dim() >= 2:
                t.copy_(noise / t[0].numel() ** 0.5)
            elif name.endswith(('running_var', 'weight', 'scale')):
                t.copy_(1 + PERTURBATION * noise).abs_()
            else:
                t.copy_(PERTURBATION * noise)
    return model


def build_pair(name: str, folder: str) -> Tuple[Any, Any]:
    """``(transformers' model, our detector)`` of ``name`` with one set of weights:
    transformers' seeded random model saved to ``folder`` and loaded into ours (eval)."""
    from mmdet.registry import MODELS
    from mmengine.logging import MMLogger
    from transformers import DFineForObjectDetection, Deimv2ForObjectDetection

    import vitdet_plugin  # noqa: F401  (registers our modules)

    cfg = model_config(name)
    config = reference_config(cfg)
    torch.manual_seed(SEED)
    cls: Any = DFineForObjectDetection if type(config).__name__ == 'DFineConfig' \
        else Deimv2ForObjectDetection
    theirs: Any = perturb_(cls(config)).eval()
    theirs.save_pretrained(folder)
    cfg = copy.deepcopy(cfg)
    cfg.init_cfg = dict(type='Pretrained', checkpoint=folder)
    ours = MODELS.build(cfg)
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)  # not a line per loaded tensor
    try:
        ours.init_weights()
    finally:
        logger.setLevel(level)
    return theirs, ours.eval()


class ReferenceEndToEnd(nn.Module):
    """transformers' detector as one graph of the same function as ours: a ``(1, 3, H, W)``
    uint8 BGR image -> ``(boxes (1, K, 4) xyxy pixels, scores (1, K), labels (1, K))``, the
    top ``K`` (its query count) over queries x classes of the sigmoid scores, as its
    ``post_process_object_detection`` takes them."""

    mean: Tensor
    std: Tensor

    def __init__(self, model: nn.Module, mean: Tensor, std: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer('mean', mean.view(1, 3, 1, 1))  # RGB, 0-255
        self.register_buffer('std', std.view(1, 3, 1, 1))

    def forward(self, image: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        h, w = image.shape[-2:]
        x = (image.flip(1).float() - self.mean) / self.std             # (1, 3, H, W) RGB
        out = self.model(pixel_values=x)
        logits, cxcywh = out.logits, out.pred_boxes                    # (1, Q, C), (1, Q, 4)
        queries, classes = logits.shape[1:]
        scores, index = logits.sigmoid().flatten(1).topk(queries)      # (1, Q) each
        centre, side = cxcywh.split(2, -1)
        xyxy = torch.cat([centre - side / 2, centre + side / 2], -1) \
            * torch.tensor([w, h, w, h], dtype=cxcywh.dtype)            # (1, Q, 4) pixels
        boxes = xyxy.gather(1, (index // classes)[..., None].expand(-1, -1, 4))
        return boxes, scores, index % classes


def _is_all_true(x: Any) -> Any:
    """ONNX of ``aten._is_all_true`` (``torch._check`` on a tensor, which torch's exporter has
    no translation of): every element true."""
    from onnxscript import opset18

    op: Any = opset18
    return op.Cast(op.ReduceMin(op.Cast(x, to=ONNX_INT32), keepdims=0), to=ONNX_BOOL)


def _export_reference(module: ReferenceEndToEnd, image: Tensor, path: str
                      ) -> Tuple[Optional[str], List[str]]:
    """Export ``module`` at ``image``'s fixed size with torch's dynamo exporter at our opset
    (transformers' ``torch._check`` calls translated, :func:`_is_all_true`), else the
    TorchScript exporter: ``(the exporter that wrote the graph or None, why the others
    failed)``."""
    from vitdet_plugin.deploy.onnx_export import OPSET

    errors: List[str] = []
    for dynamo in (True, False):
        exporter = 'dynamo' if dynamo else 'TorchScript'
        table: Optional[Dict[Callable[..., Any], Callable[..., Any]]] = \
            {torch.ops.aten._is_all_true.default: _is_all_true} if dynamo else None
        try:
            with torch.no_grad():
                torch.onnx.export(module, (image,), path, dynamo=dynamo, opset_version=OPSET,
                                  input_names=['image'],
                                  output_names=['boxes', 'scores', 'labels'],
                                  custom_translation_table=table, external_data=False)
            return exporter, errors
        except Exception as e:  # the reason is the row's result
            cause: BaseException = e
            while cause.__cause__ is not None:  # the exporter's own error, not its wrapper
                cause = cause.__cause__
            first = (str(cause).strip().splitlines() or [''])[0]
            errors.append(f'{exporter} exporter: {type(cause).__name__}: {first[:300]}')
    return None, errors


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check_same(what: str, ours: Tuple[Any, Any], theirs: Tuple[Any, Any],
               side: int = SIZE) -> Tuple[float, float]:
    """``(top-score max abs difference, box max abs difference / side)`` of two sides'
    ``(boxes, scores)`` by descending score on a square image of ``side`` pixels
    (transformers' boxes clipped to it as mmdet's are; each box against the nearest of the
    other side's boxes whose score is within the tolerance, as near-equal scores may swap
    ranks); a ``RuntimeError`` above the tolerances (two different models)."""
    n = len(theirs[1])
    boxes, scores = np.asarray(ours[0])[:n], np.asarray(ours[1])[:n]
    their_scores = np.asarray(theirs[1])
    clipped = np.clip(np.asarray(theirs[0]), 0, side)
    score = float(np.abs(scores - their_scores).max())
    tied = np.abs(scores[:, None] - their_scores[None]) <= SCORE_TOLERANCE      # (K, K)
    distance = np.abs(boxes[:, None] - clipped[None]).max(-1)                   # (K, K)
    box = float(np.where(tied, distance, np.inf).min(1).max() / side)
    if not (score <= SCORE_TOLERANCE and box <= BOX_TOLERANCE):
        raise RuntimeError(f'{what}: the top detections differ (scores by {score:.1e}, boxes by '
                           f'{box:.1e} of the side; limits {SCORE_TOLERANCE:.0e}, '
                           f'{BOX_TOLERANCE:.0e}): the two sides are not the same model')
    return score, box


def run_dfine_latency(name: str = 'dfine_n', repeats: int = 5,
                      warmup: int = 1) -> Dict[str, Any]:
    """Build, check and time the four engines of ``name`` (module docstring); print the
    table."""
    from transformers import RTDetrImageProcessor

    from vitdet_plugin.deploy.end_to_end import EndToEndDetector, export_end_to_end
    from vitdet_plugin.deploy.end_to_end_check import compare, mmdet_predict
    from vitdet_plugin.deploy.ort_check import ort_session
    from vitdet_plugin.deploy.runner import INPUT_NAME

    with tempfile.TemporaryDirectory(prefix='dfine_latency_') as folder:
        theirs, ours = build_pair(name, os.path.join(folder, 'transformers'))
        g = torch.Generator().manual_seed(SEED)
        image = torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8, generator=g)  # BGR
        pre = ours.data_preprocessor
        wrapped = ReferenceEndToEnd(theirs, pre.mean.flatten(), pre.std.flatten()).eval()
        processor = RTDetrImageProcessor()

        def theirs_eager() -> Any:
            with torch.no_grad():
                x = (image[None].flip(1).float() - wrapped.mean) / wrapped.std
                return processor.post_process_object_detection(
                    theirs(pixel_values=x), threshold=0.0, target_sizes=[(SIZE, SIZE)])[0]

        ours_path, theirs_path = (os.path.join(folder, f'{s}.onnx') for s in ('ours', 'theirs'))
        start = time.perf_counter()
        export_end_to_end(EndToEndDetector(ours), ours_path)
        ours_export = time.perf_counter() - start
        start = time.perf_counter()
        exporter, failures = _export_reference(wrapped, image[None], theirs_path)
        theirs_export = time.perf_counter() - start
        sessions = {'ours': ort_session(ours_path, spinning=False)}
        if exporter is not None:
            try:
                sessions['theirs'] = ort_session(theirs_path, spinning=False)
            except Exception as e:  # its graph does not load: the row's result
                failures.append(f'{exporter} exporter\'s graph refused by onnxruntime: '
                                f'{str(e).strip()[:300]}')
                exporter = None
        sizes = {k: os.path.getsize(p) / MIB for k, p in
                 (('ours', ours_path), ('theirs', theirs_path)) if os.path.isfile(p)}

        feed = {INPUT_NAME: image[None].numpy()}
        ours_boxes, ours_scores, _ = mmdet_predict(ours, image)
        want = theirs_eager()
        eager_error = check_same('PyTorch eager, ours vs transformers',
                                 (ours_boxes, ours_scores),
                                 (want['boxes'].numpy(), want['scores'].numpy()))
        (parity,) = compare(sessions['ours'], ours, [image])
        engines: Dict[str, Callable[[], object]] = {
            'ours eager': lambda: mmdet_predict(ours, image), 'transformers eager': theirs_eager,
            'ours onnxruntime': lambda: sessions['ours'].run(None, feed)}
        ort_error: Optional[Tuple[float, float]] = None
        if 'theirs' in sessions:
            run_theirs = sessions['theirs'].run
            engines['transformers onnxruntime'] = lambda: run_theirs(None, {'image': feed[
                INPUT_NAME]})
            got = sessions['ours'].run(['boxes', 'scores'], feed)
            theirs_out = run_theirs(['boxes', 'scores'], {'image': feed[INPUT_NAME]})
            ort_error = check_same('onnxruntime, ours vs transformers',
                                   (got[0][0], got[1][0]), (theirs_out[0][0], theirs_out[1][0]))
        for _ in range(warmup):
            for fn in engines.values():
                fn()
        load_before = os.getloadavg()[0]
        times: Dict[str, List[float]] = {k: [] for k in engines}
        for _ in range(repeats):
            for k, fn in engines.items():
                times[k].append(_seconds(fn))
        load_after = os.getloadavg()[0]
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f'{name} vs transformers\' {type(theirs).__name__}, {SIZE}x{SIZE}, batch 1, CPU fp32, '
          f'{torch.get_num_threads()} threads, median of {repeats} interleaved runs after '
          f'{warmup} untimed; load average {load_before:.1f} -> {load_after:.1f}', flush=True)
    print('| engine | ours s | transformers s | ratio (ours / transformers) | top-300 scores '
          'max abs diff | boxes (of the side) |', flush=True)
    rows = {}
    for engine, error in (('eager', eager_error), ('onnxruntime', ort_error)):
        o, t = median[f'ours {engine}'], median.get(f'transformers {engine}')
        if t is None or error is None:
            print(f'| {engine} | {o:.3f} | - | - | - | - |', flush=True)
            continue
        rows[engine] = o / t
        print(f'| {engine} | {o:.3f} | {t:.3f} | {o / t:.2f}x | {error[0]:.1e} | '
              f'{error[1]:.1e} |', flush=True)
    print(f"export: ours {ours_export:.0f} s, {sizes['ours']:.1f} MiB (dynamic B / H / W); "
          + (f"transformers {theirs_export:.0f} s, {sizes['theirs']:.1f} MiB (fixed "
             f'{SIZE}x{SIZE}, {exporter} exporter)' if exporter else 'transformers not exported'),
          flush=True)
    for failure in failures:
        print(f'transformers\' model, {failure}', flush=True)
    print(f'parity, ours onnxruntime vs PyTorch: score error {parity.score_error:.1e}, box '
          f'error {parity.box_error:.1e} of the side ({"ok" if parity.ok else "FAILED"})',
          flush=True)
    return dict(model=name, reference=type(theirs).__name__, size=SIZE, times=times,
                ratios=rows, load=(load_before, load_after), exporter=exporter,
                export_failures=failures,
                errors=dict(eager=eager_error, onnxruntime=ort_error),
                export_s=dict(ours=ours_export, transformers=theirs_export))
