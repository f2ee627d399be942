"""`make wheelhouse` + the offline install an air-gapped cluster does: a fresh venv that has only torch (and
what torch itself requires), `pip install --no-index --find-links wheelhouse .`, torch untouched, and the
installed package runs `python -m pretrain validate` from outside the checkout."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _closure(name: str) -> list[md.Distribution]:
    """`name`'s distribution and every one it requires here (markers evaluated, no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _torch_only_site(folder: Path) -> Path:
    """A folder of links to torch's installed files and its dependencies' (nothing else of this venv)."""
    folder.mkdir()
    for dist in _closure("torch"):
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (folder / top).exists():
                (folder / top).symlink_to(src)
    return folder


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.mark.slow
def test_offline_install_from_the_wheelhouse_keeps_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, find-links or constraints of this machine
    # pip download keeps the wheels already in --dest: a wheelhouse kept between runs only re-resolves.
    default = Path.home() / ".cache" / "megapretrain" / f"wheelhouse-cp{sys.version_info.major}{sys.version_info.minor}"
    wheelhouse = Path(os.environ.get("WHEELHOUSE_CACHE", default))
    made = _run([sys.executable, str(ROOT / "scripts/wheelhouse.py"), "--dest", str(wheelhouse)], env=env,
                timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
    assert any(w.startswith("megatron_core-") for w in wheels)
    assert any(w.startswith("setuptools-") for w in wheels)  # to build the project itself offline
    assert not [w for w in wheels if w.startswith(("torch-", "nvidia_", "triton-"))]

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120).returncode == 0
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "preinstalled_torch.pth").write_text(str(_torch_only_site(tmp_path / "torch_site")) + "\n")
    probe = "import torch; print(torch.__version__, torch.__file__)"
    before = _run([str(py), "-c", probe], timeout=120)
    assert before.returncode == 0 and str(tmp_path / "torch_site") in before.stdout, before.stderr
    assert _run([str(py), "-c", "import yaml"]).returncode != 0  # nothing of the project's beyond torch yet

    install = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "--find-links",
                    str(wheelhouse), str(ROOT)], env=env, timeout=900)  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert _run([str(py), "-c", probe], timeout=120).stdout == before.stdout  # same torch, same place
    assert not [p.name for p in site.iterdir() if p.name == "torch" or p.name.startswith("torch-")]  # none here

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ok = _run([str(py), "-m", "pretrain", "validate", "tiny_llama", "data.mock=true"], cwd=outside, env=env,
              timeout=300)
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stdout + ok.stderr
