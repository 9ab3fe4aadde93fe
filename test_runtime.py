"""Tests for runtime.py: atomic files, checkpoint files, the batch split, the save-and-stop pattern."""
import os

import pytest
import torch

from runtime import UserError, load_checkpoint, save_checkpoint


def test_checkpoint_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 3, "w": torch.arange(4)})
    assert not os.path.exists(path + ".tmp")
    state = load_checkpoint(path)
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(4))
    with open(path, "r+b") as f:
        f.truncate(50)
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(path)
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint(str(tmp_path / "missing.pt"))
