"""Download every wheel the project needs beyond torch, for a target Python and platform, into one folder.

    python3 scripts/wheelhouse.py [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--dest wheelhouse]
    make wheelhouse PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64

Then, on a machine without internet that has that Python and torch installed:

    pip install --no-index --find-links wheelhouse .

pip resolves the project's dependencies for the target (so megatron-core is the newest version pyproject.toml
allows whose wheels fit that Python: 0.16.1 on 3.11, newer on 3.12+) against a stand-in torch that has no
dependencies, so neither torch nor its CUDA libraries are downloaded, and the install keeps the target's torch.
setuptools comes along to build the project itself offline. Defaults: this interpreter's version and platform.
For Python < 3.12 targets the wheelhouse also holds emerging-optimizers (Muon), which declares 3.12: install it there
with `pip install --no-index --find-links wheelhouse --no-deps --ignore-requires-python emerging-optimizers absl-py`
(as scripts/install.sh does online).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB_VERSION = "2.99.0"  # the stand-in torch: satisfies every `torch>=...` the dependencies state
BUILD_REQUIREMENTS = ["setuptools>=68"]  # pyproject.toml's build backend, to build the project offline
# Muon's package declares Python >= 3.12; for older targets it comes as scripts/install.sh installs it there:
# `pip install --no-index --find-links wheelhouse --no-deps --ignore-requires-python emerging-optimizers absl-py`.
MUON_BEFORE_312 = ["emerging-optimizers>=0.3", "absl-py"]


def local_platform() -> str:
    """This machine's manylinux tag (glibc version and CPU), e.g. manylinux_2_28_x86_64."""
    libc, version = platform.libc_ver()
    if libc != "glibc" or not version:
        raise SystemExit("wheelhouse: cannot tell this machine's glibc version; pass --platform")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def compatible_platforms(tag: str) -> list[str]:
    """A manylinux_2_Y tag and every older one it can run (pip does not expand them itself)."""
    prefix, _, rest = tag.partition("_2_")
    if prefix != "manylinux" or not rest:
        return [tag]
    minor, _, arch = rest.partition("_")
    out = [f"manylinux_2_{y}_{arch}" for y in range(int(minor), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out += [f"{name}_{arch}" for y, name in legacy.items() if int(minor) >= y]
    return out


def stub_torch(folder: Path) -> Path:
    """A dependency-free wheel named torch, for the resolver only (never copied into the wheelhouse)."""
    name = f"torch-{STUB_VERSION}-py3-none-any.whl"
    info = f"torch-{STUB_VERSION}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {STUB_VERSION}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    out = folder / name
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def project_requirements() -> list[str]:
    """[project] dependencies of pyproject.toml, torch left out (read without tomllib: Python 3.10 too)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if block is None:
        raise SystemExit("wheelhouse: no [project] dependencies in pyproject.toml")
    deps = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    return [d for d in deps if re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() != "torch"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", default=None, help="e.g. manylinux_2_28_x86_64 (default: this machine's)")
    parser.add_argument("--dest", default=str(ROOT / "wheelhouse"))
    args = parser.parse_args(argv)
    plat = args.platform or local_platform()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    target = ["--python-version", args.python_version, "--implementation", "cp", "--only-binary=:all:"]
    for tag in compatible_platforms(plat):
        target += ["--platform", tag]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # this machine's pip settings are not the target's
    env.pop("PIP_FIND_LINKS", None)
    with tempfile.TemporaryDirectory() as tmp:
        stub = stub_torch(Path(tmp))
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={STUB_VERSION}\n")
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join([*project_requirements(), *BUILD_REQUIREMENTS]) + "\n")
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--dest", str(dest),
               "--find-links", str(stub.parent), "--constraint", str(constraints), "--requirement", str(reqs),
               *target]  # fmt: skip
        print(f"wheelhouse: Python {args.python_version}, {plat} -> {dest}", flush=True)
        done = subprocess.run(cmd, env=env)
        if done.returncode == 0 and tuple(map(int, args.python_version.split(".")[:2])) < (3, 12):
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--dest",
                                   str(dest), "--no-deps", "--ignore-requires-python", *MUON_BEFORE_312, *target],
                                  env=env)
        (dest / stub.name).unlink(missing_ok=True)
    if done.returncode != 0:
        print(f"wheelhouse: pip download failed (exit {done.returncode}): a dependency may have no wheel for "
              f"Python {args.python_version} on {plat}", file=sys.stderr)
        return done.returncode
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    torch_like = [w for w in wheels if w.startswith(("torch-", "nvidia_", "triton-"))]
    if torch_like:
        print(f"wheelhouse: unexpected torch wheels {torch_like}", file=sys.stderr)
        return 1
    mcore = [w for w in wheels if w.startswith("megatron_core-")]
    print(f"wheelhouse: {len(wheels)} wheels ({', '.join(mcore)}); install offline with "
          f"`pip install --no-index --find-links {dest} .`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
