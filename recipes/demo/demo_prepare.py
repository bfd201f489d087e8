"""Generates the demo data set: synthetic 'spoken tones' in 5 classes, 8 kHz wav.

Each class is a pair of formant-like frequencies; every utterance jitters
them, has its own length (0.3 to 1.0 s) and noise. Deterministic in `seed`.
"""

import os

import numpy as np
import soundfile as sf
from common import write_manifest

SAMPLE_RATE = 8000
FORMANTS = [(300, 900), (350, 1000), (400, 1150), (450, 950), (330, 1250)]
SPLITS = {"train": 240, "valid": 60, "test": 60}


def prepare_demo(data_folder, save_folder, seed=1234):
    """Writes wavs under data_folder and train/valid/test JSON manifests in save_folder."""
    if all(os.path.exists(os.path.join(save_folder, f"{s}.json")) for s in SPLITS):
        return
    rng = np.random.default_rng(seed)
    wav_dir = os.path.join(data_folder, "wavs")
    os.makedirs(wav_dir, exist_ok=True)
    os.makedirs(save_folder, exist_ok=True)
    for split, count in SPLITS.items():
        entries = {}
        for i in range(count):
            label = int(rng.integers(len(FORMANTS)))
            duration = float(rng.uniform(0.3, 1.0))
            t = np.arange(int(duration * SAMPLE_RATE)) / SAMPLE_RATE
            f1, f2 = (f * rng.uniform(0.85, 1.15) for f in FORMANTS[label])
            wave = np.sin(2 * np.pi * f1 * t) + 0.6 * np.sin(2 * np.pi * f2 * t)
            wave = 0.3 * wave * np.hanning(len(t)) + 0.25 * rng.standard_normal(len(t))
            utt_id = f"{split}_{i:03d}"
            path = os.path.join(wav_dir, f"{utt_id}.wav")
            sf.write(path, wave.astype(np.float32), SAMPLE_RATE)
            entries[utt_id] = {"wav": path, "duration": duration, "label": label}
        write_manifest(os.path.join(save_folder, f"{split}.json"), entries)
