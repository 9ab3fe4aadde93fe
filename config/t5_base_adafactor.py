# The nanoT5 paper's Table 2 baseline: the same run with Adafactor and the inverse-square-root schedule
# python train.py config/t5_base_adafactor.py
exec(open("config/t5_base.py").read())
out_dir = "out/t5_base_adafactor"
optimizer = "adafactor"  # HF Adafactor as T5 used it: parameter scaling, update clipping at RMS 1, no momentum
lr = 1e-2  # the cap of min(1e-2, 1/sqrt(step)): constant 1e-2 for the first 10,000 steps, then 1/sqrt(step)
lr_schedule = "inverse_sqrt"  # ...and linear decay to 0 over the last 10% (6,554 steps)
