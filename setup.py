from setuptools import find_packages, setup

setup(
    name="ddp_eval",
    version="0.1.0",
    description="Exact, sharded validation/test and crash-safe checkpoints for SpeechBrain under torchrun",
    packages=find_packages(include=["ddp_eval", "ddp_eval.*"]),
    python_requires=">=3.9",
    install_requires=["speechbrain>=1.0", "torch>=2.1", "torchaudio", "hyperpyyaml", "pyyaml", "soundfile"],
    extras_require={"test": ["pytest>=7", "pytest-timeout", "webdataset"], "bench": ["matplotlib"]},
)
