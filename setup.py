"""Build script: the Python package, its pybind11 extension and the tuned kernel configs."""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

version: dict = {}
exec(open("vllm_dualgpu/_version.py").read(), version)

ext_modules = [
    Pybind11Extension(
        "vllm_dualgpu._C",
        sorted(glob("csrc/*.cpp")),
        define_macros=[("VLLM_DUALGPU_VERSION", f'"{version["__version__"]}"')],
        cxx_std=17,
        libraries=["dl"],
    )
]

setup(
    name="vllm-dualgpu",
    version=version["__version__"],
    description="Serve one model on two mismatched NVIDIA GPUs with stock vLLM and pipeline parallelism",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",  # as vLLM 0.30/0.31; 0.32+ need 3.11 (markers below)
    packages=[
        "vllm_dualgpu",
        "vllm_dualgpu.patches",
        "vllm_dualgpu.patching",
        "vllm_dualgpu.engine",
        "vllm_dualgpu.kernels",
        "vllm_dualgpu.planner",
        "vllm_dualgpu.cli",
        "vllm_dualgpu.kernel_configs",
    ],
    package_dir={"vllm_dualgpu.kernel_configs": "kernel_configs"},
    package_data={
        "vllm_dualgpu.kernel_configs": ["*.json", "README.md"],
        "vllm_dualgpu.planner": ["reference/*.json"],
    },
    # One range (vllm_dualgpu/_version.py SUPPORTED_VLLM): a supported vLLM already installed
    # stays; a fresh install gets the newest the Python allows (0.32+ require Python >= 3.11).
    install_requires=[
        f"vllm{version['SUPPORTED_VLLM']}; python_version >= '3.11'",
        "vllm>=0.30.0,<0.32; python_version < '3.11'",
        "nvidia-ml-py>=12",
        "capstone>=5",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2"],
        # benchmarks/: tables and plots of the GPU measurements
        "benchmark": ["matplotlib>=3.7"],
        # --distributed-executor-backend dualgpu-ray (docs/multi-node.md); tested with 2.60.0
        "ray": ["ray>=2.60"],
    },
    entry_points={
        "vllm.general_plugins": ["dualgpu = vllm_dualgpu:register"],
        "console_scripts": ["vllm-dualgpu = vllm_dualgpu.cli:main"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
