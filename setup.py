"""realign: plan, run and measure RLHF on GPU clusters.

Installs the packages ``realign`` (runtime, CLI) and ``planner`` (pure planning,
no torch) and builds the C++ search core ``planner._core`` from ``csrc/``.
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

core = Pybind11Extension(
    "planner._core",
    sources=["csrc/bindings.cpp", "csrc/search_core.cpp", "csrc/realloc_cost.cpp",
             "csrc/sim_memory.cpp", "csrc/simulate.cpp", "csrc/anneal.cpp"],
    include_dirs=["csrc"],
    depends=["csrc/search_core.hpp", "csrc/sim_state.hpp", "csrc/flat_table.hpp"],
    cxx_std=17,
    # -ffp-contract=off: no fused multiply-add, so the C++ core rounds exactly like
    # its Python twin (planner/search/anneal.py); a test compares them bit for bit.
    extra_compile_args=["-O2", "-ffp-contract=off"],
)

setup(
    name="realign",
    version="0.1.0",
    description="Megatron-based RLHF toolkit with an execution-plan optimizer",
    packages=find_packages(include=["realign", "realign.*", "planner", "planner.*"]),
    package_data={"planner": ["presets/*.json"]},
    ext_modules=[core],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=[
        "numpy",
        "networkx",
        "pydantic>=2",
        "PyYAML",
    ],
    extras_require={
        # The runtime (realign run) on CPU or GPU.
        "runtime": ["torch", "megatron-core==0.16.1", "einops", "psutil",
                    "safetensors", "transformers", "tokenizers", "peft", "tensorboardX",
                    # tool arguments against their JSON schemas (rollout.tools)
                    "jsonschema"],
        # Optional GPU back end: never installed on the CPU machine.
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-xdist"],
    },
    entry_points={"console_scripts": ["realign=realign.cli.main:main"]},
)
