# CPU demo: a lean Mask R-CNN on the small stem Swin of swin_retinanet_shapes.py (embed 64,
# depths 2-2-2, 8 x 8 patches with a 16-32 conv stem, window 6, strides 8/16/32) on the embedded
# shapes dataset at 192 px, trained from random init for a fixed wall-clock budget; COCO bbox +
# segm mAP. swin_panoptic_fpn_shapes.py (`make demo-seg`) adds the stuff head and explains the
# recipe. Measured (2 cores, another job on the machine for part of the run, before the GIoU /
# 32-RoI change): 1195 iterations in 9.5 minutes, segm mAP 0.444, bbox mAP 0.457.
#   DEMO_CONFIG=configs/demo/swin_mask_rcnn_shapes.py make demo
_base_ = [
    '../_base_/models/mask-rcnn_swin-stem_fpn_shapes.py',
    '../_base_/datasets/shapes_instance.py',
    '../_base_/schedules/cpu_time_budget_ema.py',  # AdamW 2e-3, 9.5-minute budget, EMA
]
image_size = 192

# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
