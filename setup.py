from setuptools import find_packages, setup

setup(
    name="ddp_eval",
    version="0.9.25",
    description="Exact, sharded validation/test and crash-safe checkpoints for SpeechBrain under torchrun",
    packages=find_packages(include=["ddp_eval", "ddp_eval.*"]),
    python_requires=">=3.9",
    # Lower bounds: the oldest pair CI tests (.ci/run; README: Supported versions).
    install_requires=["speechbrain>=1.0.3", "torch>=2.4.1", "torchaudio>=2.4.1", "hyperpyyaml", "pyyaml", "soundfile"],
    # sacrebleu: SpeechBrain's BLEUStats, in the recipe-pattern tests; pytest-xdist: two test workers (pytest.ini).
    extras_require={"test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "webdataset", "ruff", "sacrebleu",
                             "hypothesis>=6"],
                    "bench": ["matplotlib"]},
)
