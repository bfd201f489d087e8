#!/usr/bin/env python3
"""Demo recipe: classify synthetic 'spoken tones' (the data is generated, no download).

Run on one process or, sharding validation and test, on several:
    python recipes/demo/train.py hparams/demo.yaml --device=cpu
    torchrun --standalone --nproc_per_node=2 recipes/demo/train.py hparams/demo.yaml \
        --distributed_backend=gloo --device=cpu
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from common import ClassifierBrain, label_pipeline, run_recipe  # noqa: E402

from demo.demo_prepare import prepare_demo  # noqa: E402

if __name__ == "__main__":
    run_recipe(ClassifierBrain, prepare_demo, ["data_folder", "save_folder"], label_pipeline(), "error_rate")
