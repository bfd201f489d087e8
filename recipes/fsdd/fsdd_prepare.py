"""Data preparation for the Free Spoken Digit Dataset (FSDD).

Official split: takes 0-4 are the test set; takes 5-49 are training. The
validation set is held out from training: takes 5-9 (300 files), so training
keeps takes 10-49 (2,400 files).

FSDD: https://github.com/Jakobovski/free-spoken-digit-dataset (CC BY-SA 4.0).
"""

import os

import soundfile as sf
from common import write_manifest

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
VALID_TAKES = range(5, 10)
TEST_TAKES = range(0, 5)


def prepare_fsdd(data_folder, save_folder, train_takes_limit=None):
    """Writes train/valid/test JSON manifests for the recordings in data_folder.

    Arguments
    ---------
    data_folder : str
        Folder holding the ``{digit}_{speaker}_{take}.wav`` files.
    save_folder : str
        Where the manifests go.
    train_takes_limit : int, optional
        Keep only training takes below this number (quick runs and tests).
    """
    if all(os.path.exists(os.path.join(save_folder, f"{s}.json")) for s in ("train", "valid", "test")):
        return
    if not os.path.isdir(data_folder):
        raise FileNotFoundError(
            f"FSDD recordings not found in {data_folder}; expected the 'recordings' folder of "
            "https://github.com/Jakobovski/free-spoken-digit-dataset. Pass --data_folder=PATH."
        )
    splits = {"train": {}, "valid": {}, "test": {}}
    for name in sorted(os.listdir(data_folder)):
        if not name.endswith(".wav"):
            continue
        digit, speaker, take = name[:-4].split("_")
        take = int(take)
        split = "test" if take in TEST_TAKES else "valid" if take in VALID_TAKES else "train"
        if split == "train" and train_takes_limit is not None and take >= train_takes_limit:
            continue
        path = os.path.join(data_folder, name)
        info = sf.info(path)
        splits[split][name[:-4]] = {
            "wav": path, "duration": info.frames / info.samplerate,
            "label": int(digit), "word": WORDS[int(digit)], "speaker": speaker,
        }
    os.makedirs(save_folder, exist_ok=True)
    for split, entries in splits.items():
        write_manifest(os.path.join(save_folder, f"{split}.json"), entries)
