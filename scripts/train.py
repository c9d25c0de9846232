"""Launcher-agnostic entry point: `python|torchrun|accelerate launch|deepspeed scripts/train.py CONFIG [k=v ...]`."""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
