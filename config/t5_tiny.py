# The CPU demo: a tiny T5 learns Python's own documentation in about 4 minutes on 2 cores, no download needed.
# python train.py config/t5_tiny.py    (the first run prepares data/pydoc itself)
out_dir = "out/t5_tiny"
data_dir = "data/pydoc"
dataset = "pydoc"  # pydoc topics + standard-library docstrings, several MB of English that ships with Python
tokenizer = "train"  # a sentencepiece model trained on that text
vocab_size = 4000  # + 100 sentinels -> a model vocab of 4,224 (rounded up to a multiple of 128)
model = "t5-tiny"

input_length = 128  # 141 raw tokens -> 128 input + 29 target tokens
batch_size = 32  # 32 * (128 + 29) = 5,024 tokens/step
max_steps = 600
lr = 1e-2
warmup_steps = 50
min_lr = 1e-4

eval_interval = 100
eval_steps = 5
log_interval = 20
checkpoint_interval = 200

device = "cpu"
dtype = "float32"  # on 2 CPU cores bf16 autocast costs more in casts than it saves
compile = False  # compiling takes longer than this whole run
