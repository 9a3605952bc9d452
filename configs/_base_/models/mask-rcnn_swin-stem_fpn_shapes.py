# The lean Mask R-CNN of the CPU segmentation demos (configs/demo/swin_mask_rcnn_shapes.py,
# swin_panoptic_fpn_shapes.py): the small stem Swin of swin_retinanet_shapes.py (embed 64,
# depths 2-2-2, 8 x 8 patches behind a 16-32 conv stem, window 6, strides 8/16/32), a GN FPN
# (P3-P6, 64 channels), square anchors for the shapes' 15-75 px objects, a box head regressing
# decoded boxes with GIoU and 32 sampled RoIs per image. Sized for 192 px inputs (window 6
# divides the 24/12/6 token maps).
_base_ = ['./mask-rcnn_swin-t_fpn.py', './swin-stem_shapes.py']
num_classes = 5
fpn_channels = _base_.fpn_channels
strides = [8, 16, 32]

model = dict(
    backbone=_base_.stem_swin,
    neck=dict(_base_.stem_fpn, num_outs=4),  # P3-P6
    rpn_head=dict(
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        # square anchors 16-128 px on P3-P6 for the 15-75 px near-square objects
        anchor_generator=dict(scales=[2], ratios=[1.0], strides=strides + [64])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=fpn_channels, featmap_strides=strides),
        bbox_head=dict(in_channels=fpn_channels, fc_out_channels=256, num_classes=num_classes,
                       # regress decoded boxes with GIoU (mmdet's faster-rcnn giou recipe)
                       reg_decoded_bbox=True,
                       loss_bbox=dict(_delete_=True, type='GIoULoss', loss_weight=10.0)),
        mask_roi_extractor=dict(out_channels=fpn_channels, featmap_strides=strides),
        mask_head=dict(num_convs=2, in_channels=fpn_channels, conv_out_channels=fpn_channels,
                       num_classes=num_classes)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=500, max_per_img=100),
        rcnn=dict(sampler=dict(num=32, pos_fraction=0.5))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=100), rcnn=dict(max_per_img=20)))
