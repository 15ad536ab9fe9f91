"""docker/: what can be validated without a Docker engine (compose YAML, Dockerfile structure, requirements)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


def load_make_compose():
    spec = importlib.util.spec_from_file_location("make_compose", DOCKER / "make_compose.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, cur = [], ""
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word, rest.strip()))
        cur = ""
    assert not cur, "Dockerfile ends inside a continued line"
    return out


def check_compose(doc: dict, n: int) -> None:
    services = doc["services"]
    assert sorted(services) == sorted(f"node{i}" for i in range(1, n + 1))
    assert "blink" in doc["networks"]
    for i in range(1, n + 1):
        svc = services[f"node{i}"]
        assert svc["hostname"] == f"node{i}" and svc["networks"] == ["blink"]
        assert svc["image"] == "blink-horovod:gpu"
        assert re.fullmatch(r"\d+[gGmM][bB]?", str(svc["shm_size"])), svc["shm_size"]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    build = services["node1"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()


def test_committed_compose_file_is_two_nodes_and_matches_the_generator() -> None:
    doc = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    check_compose(doc, 2)
    assert doc == load_make_compose().compose(2)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_generator_for_n_nodes(n: int) -> None:
    p = subprocess.run([sys.executable, str(DOCKER / "make_compose.py"), str(n)], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    check_compose(yaml.safe_load(p.stdout), n)


def test_generator_rejects_zero_nodes() -> None:
    p = subprocess.run([sys.executable, str(DOCKER / "make_compose.py"), "0"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "nodes" in p.stderr and "Traceback" not in p.stderr


def test_dockerfile_structure() -> None:
    ins = dockerfile_instructions()
    words = [w for w, _ in ins]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    first = next(i for i, w in enumerate(words) if w != "ARG")
    assert words[first] == "FROM" and "cuda" in (ins[0][1] + ins[first][1]).lower()
    runs = " ".join(a for w, a in ins if w == "RUN")
    envs = " ".join(a for w, a in ins if w == "ENV")
    assert "scripts/install.sh" in runs, "Horovod must be built by the same install script as make install"
    assert "BLINK_GPU=1" in envs and "requirements-gpu.txt" in envs
    assert "openssh-server" in runs and "ssh-keygen" in runs
    assert ("EXPOSE", "22") in ins
    cmd = [a for w, a in ins if w == "CMD"][-1]
    assert "sshd" in cmd
    for w, a in ins:
        if w in ("COPY", "ADD"):
            srcs = [s for s in shlex.split(a) if not s.startswith("--")][:-1]
            for s in srcs:
                assert s == "." or (ROOT / s).exists(), f"{w} source {s} does not exist"


def test_gpu_requirements_parse_and_include_the_cpu_pins() -> None:
    from packaging.requirements import Requirement

    lines = [ln.strip() for ln in (DOCKER / "requirements-gpu.txt").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    includes = [ln.split(None, 1)[1] for ln in lines if ln.startswith("-r")]
    assert includes and all((DOCKER / inc).resolve().exists() for inc in includes)
    for ln in lines:
        if not ln.startswith("-"):
            req = Requirement(ln)
            assert str(req.specifier).startswith("=="), f"{ln}: pin the version"


def test_install_script_knows_the_gpu_switches() -> None:
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert "BLINK_GPU" in text and "BLINK_REQUIREMENTS" in text and "HOROVOD_GPU_OPERATIONS=NCCL" in text
    p = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install.sh")], capture_output=True, timeout=30)
    assert p.returncode == 0, p.stderr
