# The weights the full configs start from: the file the published recipe starts from (the URL
# the stock mmdet config names, or the family's official release), loaded by our backbones'
# loaders (the layout is detected). An http(s) URL is downloaded once into torch hub's cache
# ($TORCH_HOME/hub/checkpoints). Offline, or to train from random init, override it:
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/your/copy.pth
#   --cfg-options model.backbone.init_cfg=None
# Used as variables (model = dict(backbone=dict(init_cfg=dict(type='Pretrained',
# checkpoint=_base_.swin_t_in1k)))). The CPU demos (configs/demo/) train from random init.

# mmdet swin/*_swin-t-p4-w7_* configs and Mask2Former Swin-T: the official ImageNet-1k Swin-T
swin_t_in1k = ('https://github.com/SwinTransformer/storage/releases/download/v1.0.0/'
               'swin_tiny_patch4_window7_224.pth')
# the official ImageNet-1k Swin V2-T, window 8 at 256 px (microsoft/Swin-Transformer)
swinv2_t_w8_in1k = ('https://github.com/SwinTransformer/storage/releases/download/v2.0.0/'
                    'swinv2_tiny_patch4_window8_256.pth')
# ViTDet-B (detectron2 / mmdet projects/ViTDet): the MAE-pretrained ViT-B
mae_vit_b = 'https://dl.fbaipublicfiles.com/mae/pretrain/mae_pretrain_vit_base.pth'
# the official DINOv2 ViT-B/14 with 4 registers (facebookresearch/dinov2)
dinov2_vitb14_reg4 = ('https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/'
                      'dinov2_vitb14_reg4_pretrain.pth')
# the official MIM-pretrained EVA-02-B (baaivision/EVA, EVA-02 "asuka" release)
eva02_b_in21k_p14 = ('https://huggingface.co/Yuxin-CV/EVA-02/resolve/main/eva02/pt/'
                     'eva02_B_pt_in21k_p14.pt')
# DINOv3 ViT-B/16: Meta hands out download links on request (github.com/facebookresearch/dinov3),
# so there is no public URL; put the file here (or point the key at your copy)
dinov3_vitb16 = 'checkpoints/dinov3_vitb16_pretrain_lvd1689m.pth'
# DINOv3 ViT-L/16 and ViT-7B/16 (facebookresearch/dinov3 dinov3_vitl16 / dinov3_vit7b16, LVD-1689M):
# on request from Meta as well; put the files here (or point the keys at your copies)
dinov3_vitl16 = 'checkpoints/dinov3_vitl16_pretrain_lvd1689m.pth'
dinov3_vit7b16 = 'checkpoints/dinov3_vit7b16_pretrain_lvd1689m.pth'
# the official MIM-pretrained EVA-02-L (baaivision/EVA, EVA-02 "asuka" release)
eva02_l_in21k_p14 = ('https://huggingface.co/Yuxin-CV/EVA-02/resolve/main/eva02/pt/'
                     'eva02_L_pt_in21k_p14.pt')
