# DEIMv2 X on COCO: published box AP 57.8 on val2017 (Intellindust-AI-Lab/DEIMv2, 50.3M
# parameters). DINOv3 ViT-S+/16 (taps 5 / 8 / 11) + STA, encoder 256 wide (expansion 1.25,
# depth 1.37), 6 decoder layers; 58 epochs, multi-scale until 50, matcher change at 45: the
# base recipe itself (configs/deimv2/deimv2_dinov3_x_coco.yml).
# Train: tools/train.py configs/deimv2/deimv2_x.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_coco.py']
