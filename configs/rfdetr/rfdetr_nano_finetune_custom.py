# Fine-tune RF-DETR N on your own COCO-format data from RF-DETR's COCO checkpoint. Edit the three
# marked lines (classes, data_root, the checkpoint), then:
#   tools/train.py configs/rfdetr/rfdetr_nano_finetune_custom.py
# or on 4 GPUs: tools/dist_train.sh configs/rfdetr/rfdetr_nano_finetune_custom.py 4.
# The ViT and the projector load from RF-DETR's own .pth (read through vitdet_plugin.weights,
# docs/rfdetr.md); the decoder and the class head of your classes train from their init (a
# checkpoint's classifier loads only into a head of its own classes, or of mmdet's 80 COCO
# ones). The recipe is rfdetr_nano.py's (RF-DETR's: lr 1e-4, backbone layer decay 0.8, EMA,
# batch 4 x 4), for fewer epochs. The pre-flight check before training names any class of the
# annotation files missing from `classes`, with the option that fixes it.
_base_ = ['./rfdetr_nano.py']

classes = ('person', 'helmet', 'vest')       # <- your classes, in the order of your category ids
data_root = 'data/my_dataset/'               # <- annotations/{train,val}.json, train/, val/
rfdetr_nano = 'checkpoints/rf-detr-nano.pth'  # <- RF-DETR's N checkpoint
max_epochs = 50

model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=rfdetr_nano)),
             neck=dict(init_cfg=dict(type='Pretrained', checkpoint=rfdetr_nano)),
             bbox_head=dict(num_classes=len(classes)))
metainfo = dict(classes=classes)
train_dataloader = dict(dataset=dict(
    data_root=data_root, metainfo=metainfo, ann_file='annotations/train.json',
    data_prefix=dict(img='train/')))
val_dataloader = dict(dataset=dict(
    data_root=data_root, metainfo=metainfo, ann_file='annotations/val.json',
    data_prefix=dict(img='val/')))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/val.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [dict(type='MultiStepLR', by_epoch=True, begin=0, end=max_epochs,
                        milestones=[max_epochs], gamma=0.1)]
