"""
Pictures of a run: its curves and the position bias each head learned.
    python plot.py out/t5_tiny    # writes and prints out/t5_tiny/*.png
No wandb needed: the curves are log.jsonl's. A head's bias is drawn by key
- query, flat where distances share a bucket; the decoder's queries see
only keys on their left.
"""
import argparse
import json
import os

import numpy as np
import torch
from matplotlib.figure import Figure

from checkpoint import load, model_from_checkpoint
from runtime import atomic_write

def position_biases(t5):
    """{stack: bias (heads, 2 * max_distance + 1)} by key - query from
    -max_distance to max_distance, as the first layer's attention adds it"""
    m = t5.config.relative_attention_max_distance
    query, keys = torch.tensor([m]), torch.arange(2 * m + 1)
    biases = {name: attn.position_bias(query, keys)[0, :, 0].detach()
              for name, attn in (("encoder", t5.encoder.blocks[0].attn),
                                 ("decoder", t5.decoder.blocks[0].self_attn))}
    biases["decoder"][:, m + 1:] = torch.nan  # the future: masked, unseen
    return biases

def read_log(path):
    """{key: (steps, values)} of log.jsonl's numbers; where a resume logged
    a step's value twice, the later one is what the run kept"""
    curves = {}
    with open(path) as f:
        for record in map(json.loads, f):
            for key, value in record.items():
                if isinstance(value, float):
                    curves.setdefault(key, {})[record["step"]] = value
    for key, values in curves.items():
        steps = sorted(values)
        curves[key] = (steps, [values[step] for step in steps])
    return curves

def plot_curves(curves, dpi):
    panels = [keys for keys in (("loss", "val_loss"), ("lr",),
                                ("span_acc", "span_baseline"))
              if keys[0] in curves]  # a fine-tuning logs no span_acc
    fig = Figure(figsize=(7, 2.4 * len(panels)), dpi=dpi,
                 layout="constrained")
    axes = fig.subplots(len(panels), sharex=True)
    for ax, keys in zip(axes, panels):
        for key in keys:
            if key in curves:
                ax.plot(*curves[key], label=key)
        ax.legend()
    axes[0].set_yscale("log")
    axes[-1].set_xlabel("step")
    if "elapsed" in curves:  # the clock's minutes above the steps
        steps, seconds = curves["elapsed"]
        minutes = np.divide(seconds, 60)
        top = axes[0].secondary_xaxis("top", functions=(
            lambda s: np.interp(s, steps, minutes),
            lambda t: np.interp(t, minutes, steps, right=np.nan)))
        top.set_xlabel("minutes of training")
    return fig

def plot_biases(biases, dpi):
    fig = Figure(figsize=(7, 5), dpi=dpi, layout="constrained")
    for ax, (name, bias) in zip(fig.subplots(2, sharex=True), biases.items()):
        m = bias.size(1) // 2
        for head, row in enumerate(bias):
            ax.plot(range(-m, m + 1), row, label=f"head {head}")
        ax.axvline(0, color="black", linewidth=0.5)
        ax.set_ylabel(f"{name} bias")
        ax.legend(ncol=4, fontsize="small")
    ax.set_xlabel("key - query")
    return fig

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("run", help="a run's out_dir, a step folder or "
                        "Hugging Face weights, as sample.py takes them")
    parser.add_argument("--out", help="where the PNGs go (default: the "
                        "run's folder; for weights, this one)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels an inch")
    args = parser.parse_args()
    ckpt = load(args.run)
    log = os.path.join(args.run, "log.jsonl")
    is_run = os.path.isdir(os.path.join(args.run, "ckpt"))
    if is_run and not os.path.isfile(log):
        raise SystemExit(f"error: {args.run} is a run without a log.jsonl: "
                         f"pass one of its step folders for the bias alone")
    out = args.out or (args.run if is_run else ".")
    figures = {"position_bias": plot_biases(
        position_biases(model_from_checkpoint(ckpt)), args.dpi)}
    if is_run:
        figures["curves"] = plot_curves(read_log(log), args.dpi)
    os.makedirs(out, exist_ok=True)
    for name, fig in figures.items():
        path = os.path.join(out, f"{name}.png")
        with atomic_write(path) as f:
            fig.savefig(f, format="png")
        print(path)
