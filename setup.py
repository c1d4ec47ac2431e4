from setuptools import find_packages, setup

setup(
    name="fastmoe_xpu",
    version="0.1.0",
    description="Fast Mixture-of-Experts training for Intel GPUs (XPU), CUDA GPUs and the CPU",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fastmoe_xpu", "fastmoe_xpu.*", "trainer", "trainer.*", "bench", "bench.*"]),
    install_requires=["torch>=2.5", "numpy"],
    extras_require={
        "triton": ["triton>=3.1"],
        "hf": ["transformers>=4.46"],
        "test": ["pytest", "pytest-benchmark", "transformers>=4.46", "triton>=3.1"],
        "trainer": ["transformers>=4.46", "tokenizers", "tqdm", "matplotlib", "pyarrow"],
        "bench": ["transformers>=4.46", "matplotlib", "tqdm"],
    },
)
