# COCO instance segmentation with the DETR-style multi-scale + random-crop augmentation used by
# the Swin 3x recipes (480-800 short side, or 400-600 resize, 384-600 crop, 480-800 resize).
_base_ = './coco_instance.py'

backend_args = None
ms_scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333), (640, 1333),
             (672, 1333), (704, 1333), (736, 1333), (768, 1333), (800, 1333)]
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomChoice',
         transforms=[
             [dict(type='RandomChoiceResize', scales=ms_scales, keep_ratio=True)],
             [dict(type='RandomChoiceResize', scales=[(400, 1333), (500, 1333), (600, 1333)],
                   keep_ratio=True),
              dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600),
                   allow_negative_crop=True),
              dict(type='RandomChoiceResize', scales=ms_scales, keep_ratio=True)],
         ]),
    dict(type='PackDetInputs')
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
