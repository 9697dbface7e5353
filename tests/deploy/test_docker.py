"""The Dockerfiles, read as Docker reads them: every COPY source exists and survives .dockerignore, the final
stage runs as a non-root user with a HEALTHCHECK and only the runtime venv, and the image's ports and config
agree with the server's. The HEALTHCHECK script runs against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hps_service.config import load_config
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda"]
HEALTHCHECK = REPO / "docker" / "healthcheck.py"


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and the build stages: continuation lines joined, comments and parser directives dropped."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, words[0]))
        elif not stages:
            assert ins.keyword == "ARG", f"{path}:{ins.line}: only ARG may come before the first FROM"
            key, _, value = ins.args.partition("=")
            global_args[key] = value.strip('"')
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


def copy_parts(ins: Instruction) -> tuple[dict[str, str], list[str], str]:
    """A COPY/ADD's --flags, sources and destination (shell or JSON form)."""
    words = shlex.split(ins.args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    if words and words[0].startswith("["):
        words = json.loads(" ".join(words))
    return flags, words[:-1], words[-1]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i:end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignored(rel_path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = rel_path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negated = raw.startswith("!")
        pattern = raw[1:] if negated else raw
        regex = _glob_regex(pattern.strip("/"))
        if any(regex.match(c) for c in candidates):
            excluded = not negated
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


@pytest.fixture(params=DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def dockerfile(request: pytest.FixtureRequest) -> tuple[Path, dict[str, str], list[Stage]]:
    global_args, stages = parse_dockerfile(request.param)
    return request.param, global_args, stages


def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile) -> None:
    path, _, stages = dockerfile
    patterns = dockerignore_patterns()
    seen_stages: list[str] = []
    copies = 0
    for stage in stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            flags, sources, _ = copy_parts(ins)
            if "from" in flags:
                assert flags["from"] in seen_stages, f"{path.name}:{ins.line}: unknown stage {flags['from']}"
                continue
            for source in sources:
                copies += 1
                target = REPO / source
                assert target.exists(), f"{path.name}:{ins.line}: COPY source {source} is not in the repository"
                files = _files_under(target)
                assert files, f"{path.name}:{ins.line}: {source} is empty"
                kept = [f for f in files if not dockerignored(str(f.relative_to(REPO)), patterns)]
                assert kept, f"{path.name}:{ins.line}: .dockerignore excludes every file of {source}"
                if source.endswith((".py", ".yaml")) or source == "pyproject.toml":
                    assert kept == files, f"{path.name}:{ins.line}: .dockerignore excludes {source}"
        seen_stages.append(stage.name)
    assert copies >= 4


def test_package_sources_reach_the_build_context() -> None:
    patterns = dockerignore_patterns()
    package = [p for p in (REPO / "hps_service").rglob("*.py") if "__pycache__" not in p.parts]
    assert package and not [p for p in package if dockerignored(str(p.relative_to(REPO)), patterns)]
    for outside in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "var/rocksdb/CURRENT",
                    "hps_service/__pycache__/config.cpython-311.pyc", "deploy/helm/hps/values.yaml"):
        assert dockerignored(outside, patterns), f"{outside} would be sent to the Docker daemon"


def test_dockerignore_matcher_follows_docker_rules() -> None:
    assert dockerignored("a/b/c.txt", ["a"])
    assert not dockerignored("a/b/c.txt", ["*", "!a"])
    assert dockerignored("a/__pycache__/x.pyc", ["*", "!a", "**/__pycache__"])
    assert not dockerignored("ab/c", ["a"])
    assert dockerignored("x/y.pyc", ["**/*.py[cod]"])


def test_multi_stage_with_only_the_venv_in_the_final_image(dockerfile) -> None:
    path, _, stages = dockerfile
    assert len(stages) >= 2, f"{path.name} must be multi-stage"
    build, final = stages[0], stages[-1]
    assert build.base == final.base, "the venv is only valid on the interpreter it was built with"
    copies_from = [copy_parts(i) for i in final.all("COPY") if "from" in copy_parts(i)[0]]
    assert [(f["from"], s, d) for f, s, d in copies_from] == [(build.name, ["/opt/hps"], "/opt/hps")]
    final_runs = " ".join(i.args for i in final.all("RUN"))
    for build_tool in ("pip install", "gcc", "build-essential", "python3-dev", "python3-venv", "git "):
        assert build_tool not in final_runs, f"{path.name}: the final stage installs {build_tool}"
    assert "pip install" in " ".join(i.args for i in build.all("RUN"))


def test_final_stage_runs_as_non_root_with_a_python_healthcheck(dockerfile) -> None:
    path, _, stages = dockerfile
    final = stages[-1]
    users = final.all("USER")
    assert users, f"{path.name}: the final stage sets no USER"
    user = users[-1].args.split(":")[0]
    uid_arg = {i.args.partition("=")[0]: i.args.partition("=")[2] for i in final.all("ARG")}
    resolved = uid_arg.get(user.strip("${}"), user)
    assert resolved not in ("0", "root", ""), f"{path.name}: runs as {users[-1].args}"
    assert int(resolved) >= 1000
    checks = final.all("HEALTHCHECK")
    assert len(checks) == 1
    command = json.loads(checks[0].args.split("CMD", 1)[1])
    assert command[0].endswith("python") and command[1] == "/usr/local/lib/hps/healthcheck.py"
    healthcheck_copy = [copy_parts(i) for i in final.all("COPY") if copy_parts(i)[2] == command[1]]
    assert healthcheck_copy and healthcheck_copy[0][1] == ["docker/healthcheck.py"]


def test_image_ports_and_config_match_the_server(dockerfile) -> None:
    _, _, stages = dockerfile
    final = stages[-1]
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1].args)
    cmd = json.loads(final.all("CMD")[-1].args)
    assert entrypoint == ["hps"] and cmd == ["serve", "--config", "/etc/hps/config.yaml"]
    config_copy = [copy_parts(i) for i in final.all("COPY") if copy_parts(i)[2] == "/etc/hps/config.yaml"]
    cfg = load_config(REPO / config_copy[0][1][0])
    assert cfg.server.host == "0.0.0.0"
    exposed = {int(p) for i in final.all("EXPOSE") for p in i.args.split()}
    assert exposed == {cfg.server.grpc_port, cfg.server.http_port}
    runs = " ".join(i.args for i in final.all("RUN"))
    assert str(cfg.persistent.path).startswith("/var/lib/hps/") and "chown -R hps:hps /var/lib/hps" in runs


def test_cuda_image_installs_the_gpu_extra_from_its_lock() -> None:
    _, stages = parse_dockerfile(REPO / "docker" / "Dockerfile.cuda")
    assert "docker/requirements-cuda.lock" in " ".join(i.args for i in stages[0].all("COPY"))
    assert "--require-hashes" in " ".join(i.args for i in stages[0].all("RUN"))
    sys.path.insert(0, str(REPO / "docker"))
    try:
        from lock_requirements import IMAGES
    finally:
        sys.path.pop(0)
    cuda = next(image for image in IMAGES if image.lock.name == "requirements-cuda.lock")
    assert cuda.extras == ("gpu", "otel") and cuda.python == "3.12"  # Ubuntu 24.04's python3, as the CUDA base
    for image in IMAGES:  # server.tracing works in either image: the otel extra is locked in both
        assert "otel" in image.extras
        assert re.search(r"^opentelemetry-sdk==", image.lock.read_text(), re.M), image.lock
    out = subprocess.run([sys.executable, str(REPO / "docker/pyproject_requirements.py"),
                          str(REPO / "pyproject.toml"), "gpu"], capture_output=True, text=True, check=True)
    assert any(line.startswith("cupy-cuda12x") for line in out.stdout.splitlines())
    assert any(line.startswith("rocksdict") for line in out.stdout.splitlines())
    bad = subprocess.run([sys.executable, str(REPO / "docker/pyproject_requirements.py"),
                          str(REPO / "pyproject.toml"), "nonesuch"], capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "nonesuch" in bad.stderr


def _healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HPS_")}
    return subprocess.run([sys.executable, str(HEALTHCHECK)], env={**clean, **env},
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def http_server(tmp_path: Path):
    """A real HTTP server on 127.0.0.1 that answers 200 for /healthz while the file exists, 404 after."""
    (tmp_path / "healthz").write_text("ok")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.1)
        yield port, tmp_path
    finally:
        proc.terminate()
        proc.wait(10)


def test_healthcheck_reads_the_port_the_server_uses(http_server, tmp_path: Path) -> None:
    port, root = http_server
    assert _healthcheck({"HPS_SERVER__HTTP_PORT": str(port)}).returncode == 0
    config = tmp_path / "config.yaml"
    config.write_text(f"server: {{http_port: {port}}}\n")
    assert _healthcheck({"HPS_CONFIG": str(config)}).returncode == 0
    (root / "healthz").unlink()
    failed = _healthcheck({"HPS_SERVER__HTTP_PORT": str(port)})
    assert failed.returncode == 1 and "/healthz" in failed.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    result = _healthcheck({"HPS_SERVER__HTTP_PORT": str(free_port())})
    assert result.returncode == 1


@pytest.mark.parametrize("lock,extras", [("requirements.lock", []), ("requirements-cuda.lock", ["gpu"])])
def test_lock_pins_every_dependency_with_hashes(lock: str, extras: list[str]) -> None:
    """Each image's lock (installed with --require-hashes) satisfies pyproject.toml's dependencies (and the CUDA
    image's extra) and pins each package once, to one version, with the sha256 of its file for x86_64 and for
    aarch64 (a compiled package has two): a stale lock after a dependency change fails here."""
    from packaging.requirements import Requirement

    sys.path.insert(0, str(REPO / "docker"))
    try:
        from pyproject_requirements import requirements
    finally:
        sys.path.pop(0)
    pins: dict[str, str] = {}
    hashes: dict[str, list[str]] = {}
    for line in (REPO / "docker" / lock).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        spec, *files = line.split(" --hash=sha256:")
        name, _, version = spec.partition("==")
        assert version and files and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in files), line
        assert name not in pins, f"{name} pinned twice"
        pins[name], hashes[name] = version, files
    for dep in requirements(str(REPO / "pyproject.toml"), extras):
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{dep} is not in docker/{lock}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {name}=={pins[name]}, wants {dep}"
        for extra in req.extras & {"hiredis"}:  # redis[hiredis]: the extra is a package
            assert extra in pins, f"{dep}: extra {extra} not locked"
    assert "hps-client" not in pins and "setuptools" in pins  # local distributions are built without isolation
    for compiled in ("numpy", "grpcio", "rocksdict", "numba"):  # a wheel per architecture
        assert len(set(hashes[compiled])) == 2, f"{compiled}: {hashes[compiled]}"


def test_images_compile_the_kernels_at_build_time_for_any_cpu(dockerfile) -> None:
    """Ready means warm (issue 14, defect 6): the build stage runs the warm-up into a directory of /opt/hps (which the
    final stage copies), as generic x86-64 code; the final stage seeds NUMBA_CACHE_DIR from it with the same CPU name
    (numba ignores a cache compiled for another CPU name)."""
    path, _, stages = dockerfile
    build, final = stages[0], stages[-1]
    runs = [i.args for i in build.all("RUN") if "-m hps_service.jit.warmup" in i.args]
    assert len(runs) == 1, f"{path.name}: the build stage does not run python -m hps_service.jit.warmup"
    cache_dir = re.search(r"NUMBA_CACHE_DIR=(\S+)", runs[0]).group(1)
    assert cache_dir.startswith("/opt/hps/")
    env = " ".join(i.args for i in final.all("ENV"))
    assert f"HPS_KERNEL_CACHE_SEED={cache_dir}" in env and "NUMBA_CACHE_DIR=/tmp/" in env
    for stage in (build, final):
        args = {i.args.partition("=")[0]: i.args.partition("=")[2] for i in stage.all("ARG")}
        assert args.get("NUMBA_CPU_NAME") == "generic", f"{path.name}: stage {stage.name}"
        assert "NUMBA_CPU_NAME=${NUMBA_CPU_NAME}" in " ".join(i.args for i in stage.all("ENV"))
