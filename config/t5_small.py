# T5-v1.1-small (77M) with nanoT5's recipe: the same data and schedule at about a third of base's compute
# python train.py config/t5_small.py
exec(open("config/t5_base.py").read())
out_dir = "out/t5_small"
model = "t5-v1_1-small"
