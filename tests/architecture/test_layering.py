"""The import structure of the library, read from the source (AST; nothing is imported).

- no import cycles among ``fp8`` modules, counting imports inside functions too (strongly connected
  components of the module graph);
- ``fp8/`` never imports ``megatron`` or ``tools``; ``megatron/training/`` never imports ``tools``
  (scripts are not packaged: library code importing them breaks a non-editable install);
- ``fp8``'s layers, :data:`LAYERS`, lowest first: a module imports only from its own layer or below.

Exceptions, each with its reason, would be listed in :data:`KNOWN_EXCEPTIONS` (there are none).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fp8", "megatron/training")

# fp8's layers, lowest first (the order the code has). A module belongs to the longest entry that is a
# prefix of its name (a package entry covers its submodules); an import may reach its own layer or a lower
# one. Kernels and the GEMM work on payloads and scales (plain tensors); Float8Tensor sits above them.
LAYERS = (
    # eligibility: whether a linear runs in FP8 (plain Python); testing: models for tests, benchmarks, examples (torch)
    ("fp8.formats", "fp8.eligibility", "fp8.testing"),
    ("fp8.launches",),  # device launches counted at the dispatcher (torch only)
    # comm_trace: recorded calls and NCCL's rules (plain data); host_read: device values read at a fixed step
    ("fp8.comm_trace", "fp8.host_read"),
    ("fp8.comm",),  # every collective: counted, FP8 as bytes, on the group's device (needs only the formats)
    ("fp8.cast",),
    ("fp8.kernels.backend", "fp8.kernels.triton_formats", "fp8.kernels.triton_cast", "fp8.kernels.triton_adam",
     "fp8.kernels.cast_transpose_amax", "fp8.kernels.triton_block_gemm", "fp8.kernels.triton_quantize",
     "fp8.kernels.triton_multi_tensor", "fp8.kernels.triton_fp4"),
    ("fp8.ops",),  # the fused kernels as torch.library custom ops: torch references, Triton launched on CUDA
    ("fp8.scaling",),
    # block scale grids (power-of-two scale per block); MX/NVFP4 swizzled layouts; NVFP4 numerics (torch reference)
    ("fp8.blocks", "fp8.microscaling", "fp8.fp4"),
    ("fp8.kernels", "fp8.gemm"),  # grad accumulation (+ its Triton launch), the package's re-exports; FP8 GEMM
    ("fp8.subclass_dispatch",),  # the dispatch skeleton both scaled tensor subclasses share (torch only)
    ("fp8.tensor", "fp8.scaled_fp16"),  # FP8 values; the scaled FP16 gradient buffer (grad_accumulation="fp16")
    ("fp8.serialization",),
    ("fp8.quantizers",),  # one quantizer per tensor role: GEMM operands from fused kernels
    ("fp8.mxfp8", "fp8.nvfp4"),  # the recipe modules: their quantizers on the quantizer core
    ("fp8.recipes",),  # which block each GEMM operand uses; a recipe makes a linear's quantizers
    ("fp8.linear", "fp8.embedding", "fp8.grouped_gemm", "fp8.moe"),  # grouped_gemm/moe: MoE experts; embedding: the FP8 table (E4M3 rows), its gradient per the linear config
    ("fp8.convert", "fp8.smooth_swiglu", "fp8.memory", "fp8.activations", "fp8.frozen", "fp8.stats", "fp8.precision_rules", "fp8.debug"),  # frozen: evaluation-only FP8 models; activations: saved-tensor hooks, FP8 in 1x128 tiles
    # closed-loop precision: automatic fallback (decisions from fp8.stats, settings through fp8.convert) and scheduled
    # precision (high precision from a step on)
    ("fp8.fallback", "fp8.schedule"),
    ("fp8.distributed",),
    ("fp8.parallel",),
    ("fp8.optim",),
    ("fp8.checkpoint", "fp8.export"),  # export: trained FP8 weights in serving formats, and their import
    ("fp8.initialize",),
    ("fp8.integrations",),  # other libraries' trainers (transformers.Trainer) on fp8.initialize; never imported by fp8
    ("fp8",),  # the package's __init__: the public API, above everything
)

# (importer, imported) module edges tolerated, each with its reason; test_known_exceptions_are_still_needed
# fails for an entry no longer used.
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


SOURCES = _sources()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in the file (functions included), relative imports
    resolved; ``from package import name`` counts as importing ``package.name`` when that is a module."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                out.add(child if child in SOURCES else module)
    return out


GRAPH = {name: _imports(name, path) for name, path in SOURCES.items()}


def _local_edges(prefix: str) -> dict[str, set[str]]:
    return {
        name: {target for target in targets if target in SOURCES and target.startswith(prefix)}
        for name, targets in GRAPH.items() if name.startswith(prefix)
    }


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(sorted(component))
    return components


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry != "fp8" and module.startswith(entry + "."))  # "fp8": __init__ only
            if covers and len(entry) > best_len:
                best, best_len = i, len(entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in tests/architecture/test_layering.py"
    return best


def _fp8_graph_without_exceptions() -> dict[str, set[str]]:
    return {name: {t for t in targets if (name, t) not in KNOWN_EXCEPTIONS} for name, targets in _local_edges("fp8").items()}


def test_the_graph_is_read():
    assert "fp8.optim.adam" in SOURCES and "megatron.training.data.datasets" in SOURCES
    assert "fp8.optim.base" in GRAPH["fp8.optim.adam"]
    assert "fp8.tensor" in GRAPH["fp8.optim.base"]  # relative import, resolved
    assert "megatron.training.data.corpus" in GRAPH["megatron.training.data.datasets"]  # from package import module


def test_every_fp8_module_has_a_layer():
    for name in SOURCES:
        if name.startswith("fp8"):
            _layer(name)


def test_cycle_detection_finds_function_level_cycles():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_fp8():
    cycles = _strongly_connected(_fp8_graph_without_exceptions())
    assert not cycles, f"import cycles among fp8 modules (function-level imports included): {cycles}"


def test_no_import_cycles_in_megatron_training():
    cycles = _strongly_connected(_local_edges("megatron.training"))
    assert not cycles, f"import cycles among megatron.training modules: {cycles}"


def test_fp8_imports_neither_megatron_nor_tools():
    bad = sorted((name, target) for name, targets in GRAPH.items() if name.startswith("fp8")
                 for target in targets if target.split(".")[0] in ("megatron", "tools"))
    assert not bad, f"fp8 is the engine under megatron/training and tools: {bad}"


def test_megatron_training_never_imports_tools():
    bad = sorted((name, target) for name, targets in GRAPH.items() if name.startswith("megatron.training")
                 for target in targets if target.split(".")[0] == "tools" or target.startswith("examples")
                 or target.startswith("benchmarks"))
    assert not bad, f"scripts are not packaged; move the code into megatron/training: {bad}"


def test_fp8_imports_only_go_down_the_layers():
    upward = sorted(
        (name, target)
        for name, targets in _fp8_graph_without_exceptions().items()
        for target in targets
        if _layer(target) > _layer(name)
    )
    assert not upward, (
        "imports from a higher fp8 layer (LAYERS in tests/architecture/test_layering.py, lowest first): "
        + ", ".join(f"{a} -> {b}" for a, b in upward)
    )


def test_known_exceptions_are_still_needed():
    edges = {(name, t) for name, targets in _local_edges("fp8").items() for t in targets}
    stale = sorted(KNOWN_EXCEPTIONS - edges)
    assert not stale, f"remove these from KNOWN_EXCEPTIONS, the imports are gone: {stale}"


# -- public seams: no module reaches into another module's private names -------------------------------------------
IMPORTERS = ("fp8", "megatron/training", "tools", "examples", "benchmarks")


def _exported(path: Path) -> set[str] | None:
    """The module's ``__all__`` (None where it has none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _seam_violations(path: Path, name: str, sources: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports of another project module's private names (``from m import _x``, ``m._x`` on a module imported
    under a name) or of names missing from its ``__all__``."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    where = path.relative_to(root)
    out, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                module = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module not in sources or module == name:
                continue
            exported = _exported(sources[module])
            for alias in node.names:
                if f"{module}.{alias.name}" in sources:
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif _private(alias.name):
                    out.append(f"{where}:{node.lineno} imports the private {module}.{alias.name}")
                elif exported is not None and alias.name != "*" and alias.name not in exported:
                    out.append(f"{where}:{node.lineno} imports {module}.{alias.name}, not in its __all__")
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name in sources})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            out.append(f"{where}:{node.lineno} uses the private {modules[node.value.id]}.{node.attr}")
    return out


def _all_sources() -> dict[str, Path]:
    found = dict(SOURCES)
    for folder in IMPORTERS[2:]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(path)] = path
    found["pretrain_gpt"] = ROOT / "pretrain_gpt.py"
    return found


def test_the_seam_check_sees_private_and_unexported_imports(tmp_path):
    (tmp_path / "a.py").write_text("__all__ = ['pub']\n_hidden = 1\npub = 2\nother = 3\n")
    (tmp_path / "b.py").write_text("from a import _hidden, pub, other\nimport a as m\nm._hidden\n")
    sources = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    found = _seam_violations(tmp_path / "b.py", "b", sources, root=tmp_path)
    assert len(found) == 3 and "private a._hidden" in found[0] and "a.other, not in its __all__" in found[1]


def test_modules_use_each_other_through_public_names():
    """Across modules of the project (fp8, megatron/training, tools, examples, benchmarks, pretrain_gpt.py), a name
    used is public: no leading underscore, and in the module's ``__all__`` where it has one."""
    sources = _all_sources()
    violations = [v for name, path in sorted(sources.items()) for v in _seam_violations(path, name, sources)]
    assert not violations, "\n".join(violations)


# -- megatron-core: patched and read privately in one place ------------------------------------------------------------
COMPAT = ROOT / "megatron" / "training" / "compat"


def _megatron_core_reaches(path: Path) -> list[str]:
    """Where ``path`` reaches into megatron-core beyond its public names: a private name imported from it, a module
    of it named as a string (what rebinding its globals needs), an override of its private ``_communicate``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            found += [f"{path.name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("megatron.core."):
            found.append(f"{path.name}:{node.lineno} names module {node.value!r}")
        elif isinstance(node, ast.FunctionDef) and node.name == "_communicate":
            found.append(f"{path.name}:{node.lineno} overrides _communicate")
    return found


def test_megatron_core_is_reached_into_only_from_the_compat_package():
    sources = [p for d in ("megatron", "fp8", "tools") for p in (ROOT / d).rglob("*.py")] + [ROOT / "pretrain_gpt.py"]
    outside = [hit for p in sources if COMPAT not in p.parents for hit in _megatron_core_reaches(p)]
    assert outside == [], outside
    inside = [hit for p in COMPAT.rglob("*.py") for hit in _megatron_core_reaches(p)]
    assert inside, "the check finds nothing in the compat package either: it cannot fail"


def test_another_megatron_core_version_is_refused_naming_the_fix():
    import pytest

    from megatron.training.compat import (MEGATRON_CORE_VERSION, MegatronCoreVersionError,
                                          check_megatron_core_version)

    assert check_megatron_core_version() == MEGATRON_CORE_VERSION  # the installed one, read from its metadata
    with pytest.raises(MegatronCoreVersionError, match=rf"megatron-core 0.15.0 is installed; .* "
                                                       rf"pip install megatron-core=={MEGATRON_CORE_VERSION}"):
        check_megatron_core_version("0.15.0")


# -- tests use the project through its public names -------------------------------------------------------------------
PROJECT = ("fp8", "megatron", "benchmarks", "tools", "examples", "tests")


def _private_uses(path: Path) -> list[str]:
    """A private name of the project (``_x``) that ``path`` imports or reads from one of its modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT \
                and not (node.module or "").startswith("megatron.core"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT[:2] and not alias.name.startswith("megatron.core"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{path.name}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_tests_use_public_names_only():
    hits = [hit for path in sorted((ROOT / "tests").rglob("*.py")) for hit in _private_uses(path)]
    assert hits == [], hits


def test_the_public_name_check_sees_private_uses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import fp8\nfrom fp8.scaling import _x\nfrom megatron.training import training\n"
                     "training._loss(1)\nfp8.scaling._probe\n")
    assert len(_private_uses(probe)) == 3


def test_nothing_imports_the_examples():
    """``examples/`` sits on the library: no library module, test, benchmark or tool imports it (tests run its scripts)."""
    sources = [p for d in ("fp8", "megatron", "tests", "benchmarks", "tools", "examples") for p in (ROOT / d).rglob("*.py")]
    hits = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            hits += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "examples"]
    assert hits == [], hits


def test_the_training_side_has_at_most_ten_top_level_modules():
    """megatron/training/ by concern: at most 10 modules at its top, the rest in subpackages (model building and
    the loop at the top; monitoring/, data/, checkpointing/, planning/, distributed/, compat/, finetune/)."""
    top = sorted(p.name for p in (ROOT / "megatron/training").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, top


def test_the_level_table_is_written_once():
    """fp8.initialize and pretrain_gpt.py's optimizer build the FP8 levels' optimizers through one table
    (fp8.optim.wrap.wrap_for_level); only the baseline's ZeRO-1 (convert_to_sharded at FP32 precision, "O1") is
    the training side's own."""
    import re

    initialize = (ROOT / "fp8/initialize.py").read_text()
    training = (ROOT / "megatron/training/optimizer.py").read_text()
    for source in (initialize, training):
        assert "wrap_for_level(" in source
        assert not re.search(r"\b(convert_optimizer|MasterWeightOptimizer)\(", source)
    assert not re.search(r"\bconvert_to_sharded\(", initialize)
    assert all(call.startswith('convert_to_sharded(base, {}, "O1"') or call.startswith('convert_to_sharded(base, {}, "O1",')
               for call in re.findall(r'convert_to_sharded\([^\n]*', training))
