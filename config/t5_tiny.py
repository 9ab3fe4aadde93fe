# The CPU demo: a tiny T5 learns Python's own documentation in 4-5 minutes on 2 cores, no download needed.
# python train.py config/t5_tiny.py    (the first run prepares data/pydoc itself)
out_dir = "out/t5_tiny"
data_dir = "data/pydoc"
dataset = "pydoc"  # pydoc topics + standard-library docstrings, ~2 MB of English that ships with Python
tokenizer = "train"  # a sentencepiece model trained on that text
vocab_size = 4000  # + 100 sentinels -> a model vocab of 4,224 (rounded up to a multiple of 128)
model = "t5-tiny"

input_length = 128  # 141 raw tokens -> 128 input + 29 target tokens
batch_size = 16  # 16 * (128 + 29) = 2,512 tokens/step
max_steps = 600  # 600 * 16 * 141 = 1.35M raw tokens: about 2.5 passes over the corpus
lr = 3e-2  # 1e-2 ends at val loss 4.81 instead of 4.66
warmup_steps = 50
min_lr = 1e-4

eval_interval = 100
eval_steps = 5
log_interval = 50
checkpoint_interval = 200

device = "cpu"
dtype = "bfloat16"  # 1.75x faster than float32 on a CPU with native bf16 (AVX512-BF16); float32 on one without
compile = False  # compiling takes longer than this whole run
