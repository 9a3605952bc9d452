# Fine-tune RF-DETR N on your own COCO-format data from RF-DETR's checkpoint (`rfdetr_nano`):
#   tools/train.py configs/rfdetr/rfdetr_nano_finetune_custom.py --data /path/to/your/data/
# (4 GPUs: tools/dist_train.sh CONFIG 4 --data DIR). --data takes a Roboflow COCO export
# (train/_annotations.coco.json, valid/, test/) or annotations/instances_{train,val}.json with
# train/ and val/ and sets the splits, classes and num_classes; without it: the shapes set
# (python tools/make_shapes.py --out data/shapes/). The whole detector starts from the .pth as
# rfdetr's load_pretrain_weights (the class branches of your classes as its
# reinitialize_detection_head sets them; docs/rfdetr.md); rfdetr_nano.py's recipe, fewer epochs.
_base_ = ['./rfdetr_nano.py']

classes = ('square', 'circle', 'triangle', 'star', 'cross')  # the shapes set's (--data: yours)
data_root = 'data/shapes/'                                   # --data DIR replaces it
rfdetr_nano = 'checkpoints/rf-detr-nano.pth'                 # <- RF-DETR's N checkpoint
max_epochs = 50

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
