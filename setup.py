"""espo: RL post-training of Mixture-of-Experts reasoning models in JAX/Flax."""

import setuptools

setuptools.setup(
    name="espo",
    version="0.1.0",
    description="Each-prompt-matters RL (ESPO, zero-variance elimination, router replay) for MoE",
    packages=setuptools.find_packages(include=["espo", "espo.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7,<0.13",
        "flax>=0.11,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "chex>=0.1.90,<0.2",
        "jaxtyping>=0.3,<0.4",
        "ml-collections>=1.0,<2",
        "tensorflow-datasets>=4.9,<5",
        "numpy>=1.26,<3",
        "safetensors>=0.5,<1",
        "tqdm>=4.66,<5",
        "math-verify[antlr4_13_2]>=0.9,<0.10",
        # The trainer: input pipeline, procedural tasks, tokenizers and chat templates, logs, plots.
        "grain>=0.2.12,<0.3",
        "reasoning-gym>=0.1.20,<0.2",
        "tokenizers>=0.20,<1",
        "jinja2>=3.1,<4",
        "pyarrow>=15",
        "tensorboardX>=2.6,<3",
        "matplotlib>=3.8,<4",
    ],
    extras_require={
        # Parity tests against Hugging Face transformers. torch is pinned to the CPU build that
        # ships with the machine image so that no multi-GB GPU build is pulled on a CPU host.
        "test": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",  # a hang fails fast with a traceback
            "pytest-xdist>=3.5,<4",  # make test: two workers, a test file per worker at a time
            "hypothesis>=6.100,<7",  # property tests of the numerics
            "ruff>=0.8,<1",
            "torch==2.13.0",
            "transformers>=4.51,<6",
            # notebooks/ are executed by tests/notebooks.
            "nbclient>=0.10,<0.12",
            "nbformat>=5.10,<6",
            "ipykernel>=6.29,<8",
            "jupyter-client>=8,<9",
        ],
        # Mutation testing of the numerics modules (`make mutmut`), not needed by `make test`.
        "dev": ["mutmut>=3.2,<4"],
    },
)
