# Fine-tune RF-DETR N on your own COCO-format data from RF-DETR's COCO checkpoint. As shipped it
# fine-tunes on the shapes set (python tools/make_shapes.py --out data/shapes/); for your data,
# edit the three marked lines (classes, data_root, the checkpoint; data_root holds
# annotations/instances_train.json, annotations/instances_val.json, train/ and val/), then:
#   tools/train.py configs/rfdetr/rfdetr_nano_finetune_custom.py
# or on 4 GPUs: tools/dist_train.sh configs/rfdetr/rfdetr_nano_finetune_custom.py 4.
# The whole detector starts from RF-DETR's own .pth (the detector's init_cfg, as rfdetr's
# load_pretrain_weights: ViT, projector, decoder, queries, box branches; the class branches of
# your classes as its reinitialize_detection_head sets them; docs/rfdetr.md). The recipe is
# rfdetr_nano.py's (RF-DETR's: lr 1e-4, layer decay 0.8, EMA, batch 4 x 4), for fewer epochs.
_base_ = ['./rfdetr_nano.py']

classes = ('square', 'circle', 'triangle', 'star', 'cross')  # <- your classes (category order)
data_root = 'data/shapes/'                                   # <- your data (layout above)
rfdetr_nano = 'checkpoints/rf-detr-nano.pth'                 # <- RF-DETR's N checkpoint
max_epochs = 50
data_help = ('Expected: {data_root}annotations/instances_train.json, annotations/instances_val.json, '
             'train/ and val/ (the shapes set: python tools/make_shapes.py --out {data_root})')

model = dict(init_cfg=dict(type='Pretrained', checkpoint=rfdetr_nano),
             bbox_head=dict(num_classes=len(classes)))
metainfo = dict(classes=classes)
train_dataloader = dict(dataset=dict(
    data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_train.json',
    data_prefix=dict(img='train/')))
val_dataloader = dict(dataset=dict(
    data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_val.json',
    data_prefix=dict(img='val/')))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [dict(type='MultiStepLR', by_epoch=True, begin=0, end=max_epochs,
                        milestones=[max_epochs], gamma=0.1)]
