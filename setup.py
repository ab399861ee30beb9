"""megatron_mllm: multimodal-LLM training on megatron-core with bubble exploitation."""

from setuptools import find_packages, setup

setup(
    name="megatron_mllm",
    version="0.1.0",
    description=(
        "Train multimodal LLMs on megatron-core faster: encoder work scheduled into the "
        "backbone's pipeline and tensor-parallel bubbles."
    ),
    packages=find_packages(include=["megatron_mllm", "megatron_mllm.*"])
    + ["megatron_mllm_patches"],
    package_dir={"megatron_mllm_patches": "patches"},
    python_requires=">=3.10",
    install_requires=[
        # A bare "torch" pulls a multi-GB CUDA build; users on GPU install their own torch first.
        "torch>=2.4",
        "megatron-core==0.16.1",
        "numpy",
        "pyyaml",
        "einops",  # megatron-core's HyperCommGrid needs it
        "psutil",  # megatron-core's dist_checkpointing needs it
        "mathgenerator",  # offline math problems for the data mixture
        "scikit-learn",  # its bundled handwritten digits, captioned, for the data mixture
        "tensorboard",  # --tensorboard-dir
        "megatron-energon==7.4.1",  # our image-caption shards are energon datasets
    ],
    extras_require={
        "plot": ["matplotlib"],
        "convert": ["transformers==5.24.0"],  # tools/convert_llava.py
        "test": [
            "pytest",
            "pytest-xdist",  # make test runs on both cores
            "hypothesis",
            "matplotlib",
            "ruff",
            "transformers==5.24.0",
        ],
    },
)
