# The embedded synthetic "shapes" dataset (vitdet_plugin.datasets.shapes) as COCO panoptic
# segmentation: 256 px images; things = the 5 shape classes (ids 1-5, one segment per object),
# stuff = 'lines' (the distractor lines / arcs, id 6) and 'background' (id 7). Read by mmdet's
# CocoPanopticDataset + LoadPanopticAnnotations; scored by CocoPanopticMetric (PQ), CocoMetric
# on the instance JSON of the same images (bbox / segm mAP) and SemSegMetric (mIoU over things
# + stuff; val_evaluator says what each needs of the model). Label order (metainfo['classes']):
# things, then stuff; gt_sem_seg uses it, 255 = void.
# Generate it with `python tools/make_shapes.py --out data/shapes/`; every path derives from
# `data_root` (override with `--cfg-options data_root=...` in vitdet_plugin's tools).
# Another --classes list: set thing_classes (and classes = thing_classes + stuff_classes).
dataset_type = 'CocoPanopticDataset'
data_root = 'data/shapes/'
thing_classes = ('square', 'circle', 'triangle', 'star', 'cross')
stuff_classes = ('lines', 'background')
classes = thing_classes + stuff_classes
metainfo = dict(classes=classes, thing_classes=thing_classes, stuff_classes=stuff_classes)
image_size = 256
backend_args = None

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadPanopticAnnotations', with_bbox=True, with_mask=True, with_seg=True,
         backend_args=backend_args),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='RandomFlip', prob=[0.25, 0.25, 0.25],
         direction=['horizontal', 'vertical', 'diagonal']),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    # after Resize: the ground truth stays at the original size the predictions are scored at
    dict(type='LoadPanopticAnnotations', with_bbox=True, with_mask=True, with_seg=True,
         backend_args=backend_args),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size=8,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type=dataset_type,
        metainfo=metainfo,
        data_root=data_root,
        ann_file='annotations/panoptic_train.json',
        data_prefix=dict(img='train/', seg='annotations/panoptic_train/'),
        filter_cfg=dict(filter_empty_gt=True),
        pipeline=train_pipeline,
        backend_args=backend_args))
val_dataloader = dict(
    batch_size=8,
    num_workers=2,
    persistent_workers=True,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type=dataset_type,
        metainfo=metainfo,
        data_root=data_root,
        ann_file='annotations/panoptic_val.json',
        data_prefix=dict(img='val/', seg='annotations/panoptic_val/'),
        test_mode=True,
        pipeline=test_pipeline,
        backend_args=backend_args))
test_dataloader = val_dataloader

# CocoMetric needs the model's pred_instances (e.g. Mask2Former with
# test_cfg.instance_on=True); SemSegMetric scores against gt_sem_seg, which
# LoadPanopticAnnotations(with_seg=True) derives from the panoptic PNG, and needs the model's
# pred_sem_seg (see val_evaluator).
# SemSegMetric reads the model's `pred_sem_seg`: vitdet_plugin's SemanticMaskFormerFusionHead
# with test_cfg semantic_on=True writes it (configs/swin_mask2former_panoptic.py); no panoptic
# model of mmdet 3.3 as shipped does (PanopticFPN / MaskFormer / Mask2Former give
# pred_panoptic_seg, MaskFormerFusionHead refuses semantic_on), and there it raises KeyError:
# with such a model set val_evaluator = test_evaluator = _base_.val_evaluator[:2].
val_evaluator = [
    dict(
        type='CocoPanopticMetric',
        ann_file=data_root + 'annotations/panoptic_val.json',
        seg_prefix=data_root + 'annotations/panoptic_val/',
        backend_args=backend_args),
    dict(
        type='CocoMetric',
        ann_file=data_root + 'annotations/instances_val.json',
        metric=['bbox', 'segm'],
        format_only=False,
        backend_args=backend_args),
    dict(type='SemSegMetric', iou_metrics=['mIoU']),
]
test_evaluator = val_evaluator
