# CPU demo: RF-DETR-Seg (rfdetr_shapes.py's detector with LWDETRSegHead: RF-DETR's mask branch
# on the projector's P4 and every decoder layer's queries) trained from random init on the
# shapes set for the demos' 9.5-minute budget, evaluated with COCO bbox and segm mAP: 1,204
# iterations, bbox mAP 0.036, segm mAP 0.053 (docs/rfdetr.md). Run:
#   make demo-rfdetr-seg
# (= DEMO_CONFIG=configs/demo/rfdetr_seg_shapes.py DEMO_WORK_DIR=work_dirs/demo_rfdetr_seg
#  make demo)
# It keeps the 6 blocks, 3 taps and one level (P4) it was measured with; the mask branch keeps
# RF-DETR's defaults. Why each value: tools/dev/experiments.md.
_base_ = ['./rfdetr_shapes.py']

# the recipe this demo was measured with (docs/rfdetr.md), before rfdetr_shapes.py's
# from-scratch changes, which were measured on boxes only (LWDETRSegHead refuses
# dense_one_to_many: its matching weighs masks)
out_indices = (1, 3, 5)
model = dict(backbone=dict(arch=dict(depth=6), out_indices=out_indices),
             neck=dict(in_channels=(_base_.embed_dims,) * len(out_indices), levels=('P4',)),
             bbox_head=dict(type='LWDETRSegHead', num_levels=1, num_groups=4, anchor_size=0.05,
                            dense_one_to_many=None))
optim_wrapper = dict(optimizer=dict(lr=1e-3), clip_grad=dict(max_norm=1.0),
                     paramwise_cfg=dict(custom_keys=dict(backbone=dict(lr_mult=1.0))))

# rfdetr_shapes.py's pipelines with the instance masks loaded
train_pipeline = [dict(t, with_mask=True) if t['type'] == 'LoadAnnotations' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, with_mask=True) if t['type'] == 'LoadAnnotations' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric=['bbox', 'segm'])
test_evaluator = val_evaluator
