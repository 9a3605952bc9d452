"""DFineHead on its own (its whole-detector parity with transformers is
tests/models/test_dfine_model_parity.py): boxes of a padded batch in each image's frame, the
refusals, the core-only imports."""
import pytest
import torch
from helpers import REPO_ROOT, load_tool
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.heads import DFineHead

TINY = dict(num_classes=3, in_channels=(16, 32), embed_dims=32, num_queries=6, num_heads=2,
            ffn_dims=64, num_layers=2, num_points=(2, 2), num_denoising=4,
            test_cfg=dict(max_per_img=6))


def _head(**kwargs) -> DFineHead:
    torch.manual_seed(0)
    head = DFineHead(**{**TINY, **kwargs})
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return head.eval()


def test_padded_image_boxes_are_in_its_frame():
    """A 64 x 64 image padded to 64 x 96: the head's boxes are D-FINE's over the padded batch
    (normalised by 96 x 64) in pixels, clipped to the image; ``predict`` gives the same."""
    head = _head()
    feats = [torch.randn(1, 16, 8, 12), torch.randn(1, 32, 4, 6)]
    meta = dict(img_shape=(64, 64), batch_input_shape=(64, 96), scale_factor=(1.0, 1.0))
    with torch.no_grad():
        raw = head.decode(feats, torch.tensor([[64, 96]]), (64, 96), None)
        preds = head.predict(feats, [DetDataSample(metainfo=meta)])
    boxes = raw.head.all_bbox_preds[-1, 0]                                     # (Q, 4)
    scores, idx = raw.head.all_cls_scores[-1, 0].sigmoid().flatten().topk(6)
    want = bbox_cxcywh_to_xyxy(boxes[idx // 3]) * torch.tensor([96.0, 64.0, 96.0, 64.0])
    want = torch.minimum(want.clamp(min=0), torch.tensor(64.0))
    got = preds[0]
    assert torch.allclose(got.scores, scores, atol=1e-6)
    assert torch.equal(got.labels, idx % 3)
    assert torch.allclose(got.bboxes, want, atol=1e-4)
    naive = torch.minimum(bbox_cxcywh_to_xyxy(boxes[idx // 3]).clamp(min=0) * 64,
                          torch.tensor(64.0))  # normalised by the image: not D-FINE's frame
    assert not torch.allclose(got.bboxes, naive, atol=1)


def test_training_forward_has_denoising_and_every_layer():
    head = _head().train()
    feats = [torch.randn(2, 16, 8, 8), torch.randn(2, 32, 4, 4)]
    metas = [dict(img_shape=(64, 64), batch_input_shape=(64, 64))] * 2
    from mmengine.structures import InstanceData
    gts = [InstanceData(bboxes=torch.tensor([[4.0, 4.0, 30.0, 40.0]]), labels=torch.tensor([1])),
           InstanceData(bboxes=torch.tensor([[10.0, 8.0, 50.0, 60.0], [0.0, 0.0, 9.0, 9.0]]),
                        labels=torch.tensor([0, 2]))]
    out = head(feats, metas, gts)
    assert out.head.all_cls_scores.shape == (2, 2, 6, 3)
    # 4 // 2 objects at most = 2 groups of 2 positives + 2 negatives
    assert out.denoising is not None and out.head.dn_cls_scores.shape[2] == 8
    losses = head.loss_by_feat(out, gts, metas)
    assert 'loss_vfl' in losses and 'loss_ddf_aux_0' in losses and 'loss_bbox_dn_0' in losses
    sum(losses.values()).backward()
    assert head.dn_label_embed.weight.grad is not None


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"style='rtdetr' is not one of \('dfine', 'deimv2'\)"):
        DFineHead(3, style='rtdetr')
    with pytest.raises(ValueError, match=r'num_points=\[4, 4\] gives 2 levels but in_channels='
                                         r'\[256, 256, 256\] has 3: give one point count per '
                                         r'encoder map'):
        DFineHead(3, num_points=(4, 4))
    head = _head()
    with pytest.raises(ValueError, match=r'DFineHead expects maps of in_channels=\[16, 32\] '
                                         r'channels, got \[\(1, 32, 8, 8\), \(1, 32, 4, 4\)\]'):
        head([torch.randn(1, 32, 8, 8), torch.randn(1, 32, 4, 4)])
    out = head([torch.randn(1, 16, 8, 8), torch.randn(1, 32, 4, 4)])
    with pytest.raises(ValueError, match=r'DFineHead.loss_by_feat needs the outputs of a '
                                         r'training forward \(head.train\(\)\)'):
        head.loss_by_feat(out, [], [])


def test_the_head_reads_only_the_core_and_its_own_modules():
    tool = load_tool('dev/reading_set.py')
    heads = REPO_ROOT / 'vitdet_plugin' / 'models' / 'heads'
    read = {p.name for p in tool.closure(REPO_ROOT, [heads / 'dfine_head.py'],
                                         set(tool.DEFAULT_EXCLUDE)) if p.parent == heads}
    assert {'detr_core.py', 'detr_memory.py'} <= read
    assert not read & {'lwdetr_head.py', 'lwdetr_transformer.py', 'sdpa_detr_head.py',
                       'multiscale_memory.py', 'transformer.py', 'denoising.py'}, sorted(read)
