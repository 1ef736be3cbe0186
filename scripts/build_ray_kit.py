"""Build a pruned Ray kit: Ray 2.60.0 and its runtime dependencies for CPython 3.12 on Linux x86_64, as an
unpacked site-packages tree in one .tar.xz, for the lent GPU machine (no network, no package registry).

    python scripts/build_ray_kit.py --out .gpu/ray-2.60.0-cp312-kit.tar.xz

and there (docs/benchmarks.md, "Running on a GPU machine without a package registry", has the MLX half):

    tar -xJf .gpu/ray-2.60.0-cp312-kit.tar.xz -C .gpu/site && export PYTHONPATH=$PWD/.gpu/site:$PWD

Why prune: the cp312 wheel is 79 MB (200 MB unpacked) and a `run` call carries at most 64 MiB, next to the
34 MB MLX copy. The kit keeps Ray Core (ray.init, tasks, actors, ray.get/wait/kill, GPU resources, the
runtime_env agent, the `ray` CLI) and drops:

- ray/jars: Java workers (33 MB).
- ray/rllib, tune, train, serve, data, llm, air, workflow: the libraries built on Ray Core; nothing in
  Core imports them (the CLI's `ray serve` subcommand is added only where ray.serve imports).
- ray/dashboard/client: the dashboard's web frontend (9 MB). The dashboard's Python stays: even with
  ray.init(include_dashboard=False) Ray starts ray/dashboard/dashboard.py (the API server, minimal mode,
  --disable-frontend) and, per node, ray/dashboard/agent.py, which the raylet fate-shares with; both import
  ray.dashboard.modules.* at module discovery (traced: 100 of its files are read at ray.init).
- ray/dashboard/optional_deps.py becomes `raise ModuleNotFoundError(...)`: Ray then always takes its
  minimal-install path (no full dashboard), whatever aiohttp/grpcio/opentelemetry the machine happens to have.
  It must be ModuleNotFoundError: the dashboard's module discovery skips modules that raise it (a missing
  optional dependency) but dies on any other ImportError, and with aiohttp installed (the H200 has it) the
  modules get as far as importing optional_deps.
- typing stubs and Cython headers (*.pyi, *.pxd, *.pxi, ray/includes), ray/setup-dev.py, __pycache__.
- debug symbols: `strip --strip-unneeded` on every ELF file (_raylet.so 44->32 MB, raylet 35->23 MB,
  gcs_server 41->29 MB); the x86 BCJ filter in front of LZMA2 then takes another ~1 MB off the binaries.

Ray's bundled third-party code stays: ray/thirdparty_files (psutil, colorama),
ray/_private/thirdparty (pynvml finds the GPUs) and ray/_private/runtime_env/agent/thirdparty_files (aiohttp
and friends: the runtime_env agent, which every raylet starts). The dependencies Ray's METADATA requires
(click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml, requests) and theirs are unpacked next to
it, pinned below to versions checked together; bin/ray is the `ray` console script.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

RAY = "ray==2.60.0"
# Ray's Requires-Dist (no extras) and their own requirements, cp312 wheels where they are compiled.
DEPENDENCIES = [
    "click==8.5.1",
    "filelock==4.3.1",
    "jsonschema==4.26.0",
    "attrs==26.1.0",  # jsonschema, referencing
    "jsonschema-specifications==2025.9.1",  # jsonschema
    "referencing==0.37.0",  # jsonschema
    "rpds-py==2026.9.1",  # jsonschema, referencing
    "typing-extensions==4.16.0",  # referencing
    "msgpack==1.2.4",
    "packaging==26.4",
    "protobuf==7.36.2",
    "pyyaml==6.0.4",
    "requests==2.34.2",
    "certifi==2026.10.19.post1",  # requests
    "charset-normalizer==3.5.3",  # requests
    "idna==3.20",  # requests
    "urllib3==2.8.0",  # requests
]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64"]

# Paths under the site-packages tree that go (see the docstring for why).
PRUNE_DIRS = [
    "ray/jars",
    "ray/rllib",
    "ray/tune",
    "ray/train",
    "ray/serve",
    "ray/data",
    "ray/llm",
    "ray/air",
    "ray/workflow",
    "ray/dashboard/client",
    "ray/includes",
]
PRUNE_FILES = ["ray/setup-dev.py"]
PRUNE_SUFFIXES = (".pyi", ".pxd", ".pxi")

NO_DASHBOARD = '''"""Pruned Ray kit (scripts/build_ray_kit.py): the full dashboard is not shipped, so Ray always takes
its minimal-install path (ray.init still starts the API server and the per-node agent in minimal mode)."""

raise ModuleNotFoundError("the pruned Ray kit has no dashboard (scripts/build_ray_kit.py)")
'''

RAY_SCRIPT = """#!/usr/bin/env python3
import sys

from ray.scripts.scripts import main

if __name__ == "__main__":
    sys.exit(main())
"""


def download(specs: list[str], python_version: str, dest: Path) -> list[Path]:
    """pip download the wheels for the target interpreter (not this one)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + specs, check=True)
    return sorted(dest.glob("*.whl"))


def unpack(wheel: Path, site: Path) -> None:
    """A wheel is a zip of its site-packages files; keep the permission bits (raylet and gcs_server are
    executables), which zipfile.extractall drops."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, site))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode)


def prune(site: Path) -> int:
    """Remove what Ray Core does not use; returns the bytes removed."""
    before = tree_bytes(site)
    for rel in PRUNE_DIRS:
        shutil.rmtree(site / rel)
    for rel in PRUNE_FILES:
        (site / rel).unlink()
    for path in list(site.rglob("*")):
        if path.name == "__pycache__" and path.is_dir():
            shutil.rmtree(path)
        elif path.suffix in PRUNE_SUFFIXES and path.is_file():
            path.unlink()
    (site / "ray/dashboard/optional_deps.py").write_text(NO_DASHBOARD)
    script = site / "bin/ray"
    script.parent.mkdir(exist_ok=True)
    script.write_text(RAY_SCRIPT)
    script.chmod(0o755)
    return before - tree_bytes(site)


def strip_binaries(site: Path) -> int:
    """strip --strip-unneeded every ELF file (the dynamic symbols the loader needs stay); returns bytes saved."""
    strip = shutil.which("strip")
    if strip is None:
        print("strip not found: binaries keep their debug symbols", file=sys.stderr)
        return 0
    saved = 0
    for path in sorted(site.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.open("rb").read(4) == b"\x7fELF":
            size = path.stat().st_size
            subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
            saved += size - path.stat().st_size
    return saved


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def write_archive(site: Path, out: Path) -> None:
    """tar the tree's contents (paths relative to site-packages) into one xz stream: the three big Ray
    binaries last and side by side (they share code, which LZMA's 64 MiB window finds), the x86 BCJ filter
    first (it turns relative call addresses absolute, so repeated calls compress), fixed owners and times."""
    big = ["ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet"]
    rest = sorted(
        str(p.relative_to(site)) for p in site.rglob("*") if not p.is_dir() and str(p.relative_to(site)) not in big
    )
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        return info

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel in rest + big:
                tar.add(site / rel, arcname=rel, recursive=False, filter=normalize)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the .tar.xz to write")
    parser.add_argument("--python-version", default="3.12", help="target CPython (3.11 builds a kit to test here)")
    parser.add_argument("--work", type=Path, help="build here and keep it (default: a temporary folder)")
    parser.add_argument("--no-strip", action="store_true", help="keep the binaries' symbols")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ray-kit-") as tmp:
        work = args.work or Path(tmp)
        wheels, site = work / f"wheels-cp{args.python_version.replace('.', '')}", work / "site"
        if site.exists():
            shutil.rmtree(site)
        wheels.mkdir(parents=True, exist_ok=True)
        site.mkdir(parents=True)
        for wheel in download([RAY, *DEPENDENCIES], args.python_version, wheels):
            print(f"unpack {wheel.name}")
            unpack(wheel, site)
        print(f"unpacked: {tree_bytes(site) / 1e6:.1f} MB")
        print(f"pruned:   {prune(site) / 1e6:.1f} MB")
        if not args.no_strip:
            print(f"stripped: {strip_binaries(site) / 1e6:.1f} MB")
        print(f"kept:     {tree_bytes(site) / 1e6:.1f} MB; compressing (xz -9e, a minute or two)")
        write_archive(site, args.out)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
