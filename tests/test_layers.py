"""The package imports run one way: from a higher layer to a lower one, never back up (issue 33).

Every ``import`` of the package's modules is read from their source (module level and inside functions alike) and
each edge between two top-level parts of ``hps_service`` is checked against :data:`LAYERS`. A part may import its own
modules and any part of a lower layer; parts of one layer do not import each other unless :data:`SIDEWAYS` says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hps_service

PACKAGE = Path(hps_service.__file__).parent
CLIENT = PACKAGE.parent / "clients" / "python" / "hps_client"

#: Low to high. A name is a subpackage or a top-level module of hps_service ("" is hps_service/__init__.py).
LAYERS: list[set[str]] = [
    {"", "errors", "proto", "jit", "client", "aio_client"},  # leaves: the errors, generated stubs, numba helpers
    {"keys", "runtime"},  # key batches; process plumbing (CPUs, logs, heap, sockets, the serving gate)
    {"config"},  # the typed config
    {"shm", "rows"},  # shared-memory primitives: regions, counters, rings; row formats (fp32, fp16, bf16, int8)
    {"cache", "tiers"},  # the L1 data structure; the storage tiers
    {"engine"},  # the hierarchy: registry, read and write paths
    {"updates"},  # the Kafka update path: consumer, publisher, message
    {"fleet"},  # replicas: snapshots in a bucket, bootstrap, registrations, sharding
    {"node"},  # one node: the owner, the workers' engine, the shared store
    {"local", "admin", "trainer"},  # colocated reads; admin operations; the online trainer (it publishes updates)
    {"server"},  # protocols only: gRPC, REST, probes, metrics
    {"serve"},  # the process: composition, start, drain
    {"cli"},  # the hps command
]

#: Imports between parts of one layer, each with its reason.
SIDEWAYS: dict[tuple[str, str], str] = {}

LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def part_of(module: str) -> str:
    """The top-level part of hps_service a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every hps_service import in the file, wherever it is written."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if m == "hps_service" or m.startswith("hps_service.")]


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "proto" not in p.relative_to(PACKAGE).parts[:1])


def test_every_part_has_a_layer():
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in source_files()}
    parts.discard("__init__")
    assert parts - LAYER_OF.keys() == set(), "a new part of hps_service: give it a layer in LAYERS"
    assert LAYER_OF.keys() - parts - {"", "proto"} == set(), "LAYERS names a part that is gone"


def test_imports_run_down_the_layers():
    wrong = []
    for path in source_files():
        src = part_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for line, module in imported(path):
            dst = part_of(module)
            if dst == src or LAYER_OF[dst] < LAYER_OF[src] or (src, dst) in SIDEWAYS:
                continue
            way = "sideways" if LAYER_OF[dst] == LAYER_OF[src] else "up"
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} ({src} -> {dst}: {way})")
    assert wrong == []


def test_the_client_distribution_imports_no_server_code():
    """hps_client is installed alone (pip install hps-client): nothing in it may import hps_service."""
    offenders = [f"{path.relative_to(CLIENT.parent)}:{line} imports {module}"
                 for path in sorted(CLIENT.rglob("*.py")) for line, module in imported(path)]
    assert offenders == []


def test_the_checker_sees_an_import_that_goes_up(tmp_path):
    """The walk finds imports inside functions too (the lazy ones), so the test above cannot pass by missing them."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from hps_service.serve.process import HPSServer\n    return HPSServer\n")
    assert imported(probe) == [(2, "hps_service.serve.process")]
