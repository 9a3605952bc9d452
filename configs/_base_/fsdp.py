# Sharded training (FSDP2, docs/large_models.md): every transformer block and then the whole
# detector are sharded over the ranks (parameters, gradients and AdamW state: 1/N each); bf16
# compute and all-gathers with fp32 gradient reduction and fp32 master weights; activation
# checkpointing per block. Start with tools/dist_train.sh CONFIG NUM_GPUS (one node) or
# torchrun (several nodes). Checkpoints: checkpoint_format 'auto' writes a DCP directory (each
# rank its shards, resumable at any world size) when model + AdamW state exceed 1 GiB, else one
# file gathered on rank 0; 'dcp' / 'file' force one form (tools/dcp_convert.py converts).
runner_type = 'FSDP2Runner'
model_wrapper_cfg = dict(
    type='FSDP2Wrapper',
    mixed_precision=dict(param_dtype='bfloat16', reduce_dtype='float32'),
    activation_checkpointing=True,
    cpu_offload=False)
checkpoint_format = 'auto'
