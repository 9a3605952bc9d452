# RF-DETR N (rfdetr_nano.py: COCO box AP 48.4 published) trained sharded with FSDP2 (every ViT
# block, then the detector: parameters, gradients and AdamW state 1/N per GPU; bf16 compute with
# fp32 reductions; activation checkpointing per block; configs/_base_/fsdp.py,
# docs/large_models.md). ViT-S needs no sharding to fit: this is the switch a larger backbone or
# a larger batch would use, and the config the 2-rank test trains. Launch on 4 GPUs:
#   tools/dist_train.sh configs/rfdetr/rfdetr_nano_fsdp.py 4 --cfg-options data_root=/path/to/coco/
# (4 GPUs x 4 images = 16 per optimizer step; RF-DETR trains 4 on one GPU: docs/rfdetr.md)
_base_ = ['./rfdetr_nano.py', '../_base_/fsdp.py']
