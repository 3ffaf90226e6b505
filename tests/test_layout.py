"""The layout's boundaries. Arrows point one way: deployments -> lora_cache -> engine, and no module imports
itself back through others. The engine and the adapter tiers it uses import nothing of Ray or HTTP; the routing
side, the app and the cache actor's module import no torch."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

TORCH_SIDE = ("torch", "transformers", "safetensors", "tokenizers", "peft")
ROOT = Path(__file__).parent.parent
PACKAGES = ("engine", "lora_cache", "deployments", "benchmarks", "docs")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules `module` imports anywhere in its file: at the top, in functions, for type checking
    (a cycle through a type-only import is still two modules that each need the other to be read)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = _from_names(module, path, node)
        else:
            continue
        found |= {_known_prefix(name, known) for name in names} - {None, module}
    return found


def _from_names(module: str, path: Path, node: ast.ImportFrom) -> list[str]:
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _known_prefix(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    known = first_party_modules()
    return {module: imported(module, path, known) for module, path in known.items()}


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one (depth first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for target in graph[module]:
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                stack.append((target, path + [target]))
    return None


def arrows(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m.split(".")[0] == source
                  for t in ts if t.split(".")[0] == target)


def test_the_engine_imports_nothing_of_lora_cache_or_deployments():
    """The engine defines the protocols (engine/lora/provider.py: the adapter provider, its types, the slot table);
    lora_cache implements them and deployments composes both."""
    graph = import_graph()
    assert arrows(graph, "engine", "lora_cache") == []
    assert arrows(graph, "engine", "deployments") == []


def test_lora_cache_imports_nothing_of_deployments():
    assert arrows(import_graph(), "lora_cache", "deployments") == []


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycles = [" -> ".join(cycle) for module in graph if (cycle := cycle_from(module, graph))]
    assert cycles == []


def test_the_graph_sees_imports_where_they_are():
    """The checks above would pass on a graph that missed imports: this one knows a few arrows of each kind."""
    graph = import_graph()
    assert "engine.lora.provider" in graph["engine.llm_engine"]  # at the top
    assert "engine.async_engine" in graph["deployments.replica.llm_server"]  # inside a function
    assert "engine.errors" in graph["lora_cache.adapter_folder"]
    assert "deployments.api.events" in graph["deployments.routes.choice_streams"]


def loaded_packages(modules: str, among: tuple[str, ...]) -> list[str]:
    """The packages of `among` that a fresh interpreter has loaded after importing `modules`."""
    loaded = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(among)!r})"
    code = f"import json, sys, {modules}; print(json.dumps({loaded}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_lora_module_of_the_engine_is_in_its_lora_package():
    """The slot table, the wrappers, the segments, the shards, the kernels and the provider protocol live in
    engine/lora/, so that changing how LoRA is applied means reading one package. The C++ operators (one file each,
    engine/kernels/cpu/) are the exception: they are built as one module."""
    outside = [module for module in first_party_modules() if module.startswith("engine.")
               and not module.startswith("engine.lora") and any(word in module.rpartition(".")[2]
                                                                  for word in ("lora", "adapter"))]
    assert outside == []


DEVICE_TEST = re.compile(r"""\.type ?[!=]= ?["'](cpu|cuda)["']|\bis_cuda\b|\bcpu_ops is (not )?None""")
# the step backends choose the kernels by device, and the platform answers for the device itself
DEVICE_READERS = ("engine.backends", "engine.platform")


def test_only_the_step_backends_and_the_platform_ask_which_device_they_are_on():
    asking = sorted(module for module, path in first_party_modules().items() if module.startswith("engine.")
                    and not module.startswith(DEVICE_READERS) and DEVICE_TEST.search(path.read_text()))
    assert asking == []


def test_the_device_test_pattern_finds_each_kind_of_test():
    """The check above would pass on a pattern that matched nothing."""
    for line in ('if x.device.type == "cuda":', "if q.is_cuda:", "if cpu_ops is None:", "d.type != 'cpu'"):
        assert DEVICE_TEST.search(line), line


# The engine's parts, lowest first: a module imports only parts at or below its own. The foundation (errors, the
# config and the torch-free adapter and speculation options it names, the platform, host-to-device transfer) sits below them all; the
# engine's own modules (the runner, scheduler, executors, the engine itself) above them all.
ENGINE_PARTS = {"config": -1, "kernels": 0, "distributed": 1, "layers": 2, "lora": 2, "models": 3}
ENGINE_TOP = 4
ENGINE_FOUNDATION = {"engine", "engine.errors", "engine.config", "engine.platform", "engine.transfer",
                     "engine.free_ports", "engine.lora.ids", "engine.lora.provider", "engine.lora.merge_spec",
                     "engine.lora.config", "engine.speculative.config"}


def engine_part(module: str) -> int:
    if module in ENGINE_FOUNDATION:
        return -1
    return ENGINE_PARTS.get(module.split(".")[1], ENGINE_TOP)


def test_no_import_inside_the_engine_points_up():
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("engine.")
                    for t in ts if t.startswith("engine") and engine_part(t) > engine_part(m))
    assert upward == []


def test_the_engine_imports_no_ray_and_no_http():
    modules = "engine, engine.llm_engine, engine.llm, engine.async_engine, lora_cache.local_cache"
    assert loaded_packages(modules, ("ray", "fastapi", "starlette", "aiohttp")) == []


def test_the_routing_side_imports_no_torch():
    """The request router runs in Serve's proxy and in every handle's process, the ingress request router in a
    replica of its own: neither loads torch (about 180 MB of each process's memory, 1.6 s of its start)."""
    modules = "deployments.routing.request_router, deployments.routing.ingress_router, deployments.routing.policy"
    assert loaded_packages(modules, TORCH_SIDE + ("engine",)) == []


def test_the_app_and_the_cache_actor_import_no_torch():
    """`serve run` imports the app in a build step before any replica starts, and a replica creates the cache actor
    before it imports the engine: neither import may load torch or transformers (5.8 s of the app's import on
    2 cores with them, 1.8 s without), or it lands on the critical path of every start."""
    assert loaded_packages("deployments.app, deployments.replica.llm_server, lora_cache.actor", TORCH_SIDE) == []


def test_the_engine_package_loads_its_names_on_use():
    assert loaded_packages("engine", TORCH_SIDE) == []
    assert loaded_packages("engine.config, engine.sampling, engine.errors, engine.block_manager", TORCH_SIDE) == []
    code = "from engine import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["engine.llm", "engine.sampling"]
    missing = subprocess.run([sys.executable, "-c", "import engine; engine.NoSuchName"], capture_output=True,
                             check=False, text=True, timeout=120)
    assert missing.returncode == 1 and "module 'engine' has no attribute 'NoSuchName'" in missing.stderr


def test_no_function_outside_tests_is_over_40_lines():
    """A function that does one thing fits on a screen; a longer one is split where its steps are."""
    long = []
    for module, path in first_party_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 40:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_each_deployments_subpackage_says_what_it_owns():
    for package in sorted((ROOT / "deployments").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(package.read_text()))
        assert doc and len(doc.split()) >= 15, f"{package.parent.name}/ has no docstring saying what it owns"


def test_a_sequence_changes_through_its_own_methods():
    """The scheduler, block manager, sampler and engine move a request along by calling Sequence's methods
    (admit, took_prefix, computed, preempt, ...): none of them assigns a field of a sequence itself."""
    from dataclasses import fields

    from engine.sequence import Sequence

    names = {f.name for f in fields(Sequence)}
    writes = []
    for module, path in first_party_modules().items():
        if not module.startswith("engine.") or module == "engine.sequence":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign) else []
            writes += [f"{module}:{node.lineno} {ast.unparse(t)}" for t in targets
                       if isinstance(t, ast.Attribute) and t.attr in names and ast.unparse(t.value).endswith("seq")]
    assert writes == []
