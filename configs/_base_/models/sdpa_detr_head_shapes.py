# The SdpaDETRHead of the CPU DETR demos on the shapes dataset (swin_detr_demo.py,
# vit_detr_shapes.py, swin_detr_shapes.py, swin_detr_pretrained_shapes.py): embed 128, 8 heads,
# 1 encoder layer on the coarsest level, 3 decoder layers, 50 queries (images hold at most a
# few objects), two-stage query selection, Gaussian box prior, 20 denoising queries. Used as a
# variable: model = dict(bbox_head=dict(_base_.shapes_detr_head, in_channels=[...]), ...)
shapes_detr_head = dict(
    type='SdpaDETRHead',
    num_classes=5,
    embed_dims=128,
    num_heads=8,
    ffn_dims=512,
    num_encoder_layers=1,
    encoder_levels=(-1,),
    num_decoder_layers=3,
    num_queries=50,
    two_stage=True,
    box_prior=True,
    dn_cfg=dict(num_dn_queries=20, label_noise_scale=0.5, box_noise_scale=1.0))
