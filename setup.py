"""radix_runtime: an SGLang-style LLM serving runtime around a radix tree of KV-cache pages."""

import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

# The CPU decoder layers in one C++ call (csrc/cpu_decoder.cpp, worker/cpu_native.py): built
# against the installed torch, so only where setup.py sees it (scripts/setup.sh installs without
# build isolation for this; a build-isolated install skips it and the Python layers run).
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    build_ext = BuildExtension.with_options(use_ninja=False)  # noqa: F811 (it adds torch's flags)
except ImportError:
    CppExtension = None

try:  # pyproject.toml's [build-system] provides it; without it the Python tree is used
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:
    Pybind11Extension = None


class OptionalBuildExt(build_ext):
    """Builds the C++ extensions (csrc/) when it can. A failed build only warns: the install
    succeeds, `--radix-tree-impl auto` falls back to the Python tree and the CPU path to the
    Python decoder layers."""

    failed = False

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, no Python headers, ...
            if not self.failed:  # else it is the missing output of the failed build
                self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self.failed = True
            self._warn(exc)

    @staticmethod
    def _warn(exc: Exception) -> None:
        print(
            f"WARNING: a C++ extension was not built ({exc}); its Python twin is used",
            file=sys.stderr,
        )


ext_modules = []
if Pybind11Extension is not None:
    ext_modules.append(
        Pybind11Extension(
            "radix_runtime.scheduler._radix_tree",
            ["csrc/radix_tree.cpp", "csrc/page_allocator.cpp", "csrc/bindings.cpp"],
            include_dirs=["csrc"],
            depends=["csrc/radix_tree.h", "csrc/page_allocator.h"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    )
else:
    print("WARNING: pybind11 is not installed; the C++ radix tree is not built", file=sys.stderr)


def _openmp_flags() -> list[str]:
    """-fopenmp where torch runs its intra-op threads on OpenMP (the Linux wheels): ATen's
    at::parallel_for is inline in its headers and splits work between threads only in code
    compiled with OpenMP; without it the kernels' loops run on one thread. Compile flag only: the
    GOMP symbols bind to the libgomp that libtorch_cpu already loads (one OpenMP runtime, the
    threads torch.set_num_threads sets), never to a second copy from the compiler."""
    import torch

    return (
        ["-fopenmp"]
        if sys.platform.startswith("linux") and torch.backends.openmp.is_available()
        else []
    )


if CppExtension is not None:
    ext_modules.append(
        CppExtension(
            "radix_runtime.worker._cpu_decoder",
            ["csrc/cpu_decoder.cpp", "csrc/cpu_quant_kernels.cpp"],
            include_dirs=["csrc"],
            depends=["csrc/cpu_quant_kernels.h"],
            # the SIMD kernels carry their own target attributes and are chosen at run time
            # (__builtin_cpu_supports), so the module runs on any x86-64 CPU it is copied to
            extra_compile_args=["-O3", *_openmp_flags()],
        )
    )
else:
    print(
        "WARNING: torch is not importable here; the C++ CPU decoder is not built", file=sys.stderr
    )

setup(
    name="radix_runtime",
    version="0.1.0",
    description="LLM serving runtime with a radix-tree KV cache (tokenizer / scheduler / worker over ZeroMQ)",
    python_requires=">=3.10",
    packages=find_packages(include=["radix_runtime", "radix_runtime.*"]),
    package_data={"radix_runtime": ["worker/model_configs/*.json", "server/static/*.html"]},
    install_requires=[
        # a range the CPU wheel on the dev machines (2.13) and the H200's torch (2.11) satisfy
        "torch>=2.4,<2.14",
        "numpy",
        "pyzmq>=25",
        "msgspec>=0.18",
        "fastapi",
        "uvicorn",
        "uvloop",
        "httptools",  # uvicorn parses HTTP in C with it (pure-Python h11 without)
        "sentencepiece",
        "tokenizers>=0.19",
        "gguf>=0.10",
        "jinja2",
        "tqdm",
        "setproctitle",
        "safetensors",
        "psutil",
        "prometheus-client>=0.17",  # /metrics exposition
        # xgrammar's own dependencies but triton (1 GB, only for its CUDA kernels): scripts/setup.sh
        # installs xgrammar with --no-deps on CPU; the `grammar` extra pulls it with triton
        "apache-tvm-ffi",
        "pydantic>=2",
        "transformers",
    ],
    extras_require={
        "gpu": ["flashinfer-python==0.5.3", "triton", "xgrammar==0.2.9"],
        "grammar": ["xgrammar==0.2.9"],
        "test": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "ruff",
            "openai>=1.0",
            "jsonschema",
            "httpx",
            "transformers",
            "matplotlib",
            "playwright",  # drives Debian's Chromium for the /dashboard test
            "jsonschema",
            "sglang-router>=0.3.2,<0.4",  # the --dp tests run the real router
        ],
        # llama-cpp-python: the llama.cpp server bench/cpu_decode.py compares against (it
        # compiles llama.cpp from source: minutes; CMAKE_ARGS="-DGGML_NATIVE=ON" for this CPU)
        "bench": ["matplotlib", "httpx", "llama-cpp-python[server]"],
        # tests/integration/test_lm_eval.py (skipped without it): lm-evaluation-harness with
        # its API models; heavy (datasets, pandas, pyarrow, scikit-learn: ~4 min, ~0.5 GB)
        "eval": ["lm_eval[api]==0.4.13"],
        # `serve --dp N`: SGLang's router (a Rust binary in a wheel; the tested API is 0.3.x's)
        "router": ["sglang-router>=0.3.2,<0.4"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
    entry_points={"console_scripts": ["radix-runtime=radix_runtime.cli:main"]},
)
