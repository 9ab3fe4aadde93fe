# nanoT5's recipe: T5-v1.1-base (248M) from scratch on C4 in ~16 h on one A100 (0.56 s/step in the paper)
# python prepare.py --dataset=c4 --tokenizer=t5 --out_dir=data/c4 --max_train_tokens=4_800_000_000
# python train.py config/t5_base.py
out_dir = "out/t5_base"
data_dir = "data/c4"  # C4 en in T5's tokens
model = "t5-v1_1-base"

# span corruption at 15% noise density, mean span 3: 568 raw tokens -> 512 input + 114 target tokens
input_length = 512
batch_size = 128  # 128 examples * 512 input tokens = 65,536 input tokens/step (80,128 with the targets)
grad_accum_steps = 1  # raise it if a micro-batch of 128 does not fit your GPU; the data stays the same

# 65,536 steps * 128 examples * 568 raw tokens = 4.76B C4 tokens, about 3% of C4 en, seen once
max_steps = 65536
optimizer = "adamwscale"  # AdamW with the update scaled by each tensor's RMS, like Adafactor
lr = 2e-2
warmup_steps = 10000  # linear from 0.5 * 2e-2 = 1e-2 to 2e-2, then cosine down to 1e-5
warmup_start_factor = 0.5
min_lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0

eval_interval = 1000
eval_steps = 20  # 20 batches * 128 examples = 2,560 held-out examples
log_interval = 100
checkpoint_interval = 1000

dtype = "bfloat16"
compile = True
