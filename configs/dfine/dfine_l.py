# D-FINE L on COCO: published box AP 54.0 on val2017 (Peterande/D-FINE, 31M parameters).
# HGNetV2 B4 (stem frozen, BatchNorms fixed), 6 decoder layers; the rest is
# _base_/dfine_coco.py's (the recipe of configs/dfine/dfine_hgnetv2_l_coco.yml).
# Train: tools/train.py configs/dfine/dfine_l.py --cfg-options data_root=/path/to/coco/
# transformers' weights (ustc-community/dfine-large-coco): model.init_cfg=dict(type=
#   'Pretrained', checkpoint=FOLDER), or tools/convert_weights.py FOLDER out.pth + load_from.
_base_ = ['./_base_/dfine_coco.py']
