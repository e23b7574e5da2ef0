from setuptools import find_packages, setup

setup(
    name="megatron-flexsp",
    version="0.1.0",
    description="Heterogeneous (flexible) sequence parallelism for Megatron-LM (FlexSP as a plugin)",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_flexsp", "megatron_flexsp.*", "patches", "patches.*"]),
    package_data={"": ["*.json"]},
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.19.2",
        "highspy>=1.16,<2",
        "numpy>=1.26",
        "pyyaml>=6",
        "matplotlib>=3.8",
        "psutil>=5",  # Megatron torch_dist checkpoints
    ],
    extras_require={
        "gpu": ["transformer-engine", "flash-attn"],
        "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout>=2", "tensorboard>=2.15"],
        "logging": ["tensorboard>=2.15", "wandb"],  # Megatron's --tensorboard-dir, --wandb-project
    },
    entry_points={"console_scripts": ["flexsp=megatron_flexsp.cli:main"]},
)
