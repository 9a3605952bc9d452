# Fine-tune DEIMv2 S on your own COCO-format data from the official DEIMv2 S .pth:
#   tools/train.py configs/deimv2/deimv2_s_finetune_custom.py --data /path/to/your/data/
# (4 GPUs, DDP: tools/dist_train.sh CONFIG 4 --data DIR). --data takes a Roboflow COCO export
# (train/_annotations.coco.json, valid/, test/) or annotations/instances_{train,val}.json with
# train/ and val/ and sets the splits, classes and num_classes; without it: the shapes set
# (python tools/make_shapes.py --out data/shapes/). The whole detector starts from the file's
# EMA weights; with classes other than its 80 the class branches (encoder and decoder score
# heads, denoising embedding) keep their init, as the official load_tuning_state skips them.
# deimv2_s.py's recipe on a 36-epoch schedule.
_base_ = ['./deimv2_s.py']

classes = ('square', 'circle', 'triangle', 'star', 'cross')  # the shapes set's (--data: yours)
data_root = 'data/shapes/'                                   # --data DIR replaces it
deimv2_s = 'checkpoints/deimv2_dinov3_s_coco.pth'             # <- the official DEIMv2 S .pth
max_epochs = 36
flat_epoch = 18
no_aug_epoch = 4
policy_epochs = (4, 18, 32)
stop_epoch = 32
matcher_change_epoch = 28

model = dict(
    init_cfg=dict(type='Pretrained', checkpoint=deimv2_s),
    data_preprocessor=dict(batch_augments=[
        dict(_base_.model.data_preprocessor.batch_augments[0], mixup_epochs=(4, flat_epoch),
             copyblend_epochs=(4, stop_epoch)),
        dict(_base_.model.data_preprocessor.batch_augments[1], stop_epoch=stop_epoch)]),
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
param_scheduler = [_base_.param_scheduler[0],
                   dict(_base_.param_scheduler[1], begin=flat_epoch,
                        end=max_epochs - no_aug_epoch)]
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_epoch=policy_epochs[0]),
                dict(_base_.custom_hooks[2], switch_epoch=policy_epochs[1]),
                dict(_base_.custom_hooks[3], switch_epoch=policy_epochs[2]),
                dict(_base_.custom_hooks[4], switch_epoch=matcher_change_epoch)]
