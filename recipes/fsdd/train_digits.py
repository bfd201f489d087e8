#!/usr/bin/env python3
"""FSDD spoken-digit classification (10 classes), scored with ClassificationStats.

    torchrun --standalone --nproc_per_node=2 recipes/fsdd/train_digits.py \
        hparams/fsdd_digits.yaml --data_folder=PATH/TO/recordings \
        --distributed_backend=gloo --device=cpu
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from common import ClassifierBrain, label_pipeline, run_recipe  # noqa: E402

from fsdd.fsdd_prepare import prepare_fsdd  # noqa: E402

if __name__ == "__main__":
    run_recipe(ClassifierBrain, prepare_fsdd, ["data_folder", "save_folder", "train_takes_limit"],
               label_pipeline(), "error_rate")
