# DEIMv2 Pico on COCO: published box AP 38.5 on val2017 (Intellindust-AI-Lab/DEIMv2, 1.5M
# parameters). HGNetV2 Pico, LiteEncoder 112 wide, 3 decoder layers of 200 queries, FFN 320;
# 640 px, 500 epochs, matcher change at 450: the lite base itself
# (configs/deimv2/deimv2_hgnetv2_pico_coco.yml).
# Train: tools/train.py configs/deimv2/deimv2_pico.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_hgnetv2_lite.py']
