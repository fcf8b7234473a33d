"""The Layout in docs/contributing.md lists the layers in the order their imports follow: a layer
imports only from the layers listed before it, but for the exceptions that Layout names."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The Layout's named exceptions made at module level: (importing module, imported layer). The others
# it names (distributed/lockstep, estimator/sharded) import inside functions.
EXCEPTIONS = {("integrations/lightning", "recipes")}


# The adapters of outside libraries' private names (docs/contributing.md, "Private names") import nothing
# of autofit but errors and torch_internals (the bottom layer), so every layer may use them.
ADAPTERS = {"integrations/transformers_internals", "distributed/internals"}


def readme_layers() -> list[str]:
    text = (ROOT / "docs" / "contributing.md").read_text()
    layout = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
    return re.findall(r"^- \*\*`(\w+)/`", layout, re.M)


def test_each_layer_imports_only_the_layers_before_it():
    order = readme_layers()
    assert order == ["plans", "gpu", "engine", "estimator", "cache", "diagnosis", "distributed",
                     "integrations", "tuning", "recipes"]
    rank = {layer: i for i, layer in enumerate(order)}
    wrong = []
    for path in sorted((ROOT / "autofit").glob("*/*.py")):
        layer, module = path.parent.name, f"{path.parent.name}/{path.stem}"
        if layer not in rank:
            continue
        for node in ast.parse(path.read_text()).body:  # module-level imports: the layering
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autofit"):
                if module in ADAPTERS:
                    names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                    if not names & {"autofit.torch_internals", "autofit.errors"}:
                        wrong.append(f"{module}, an adapter, imports {node.module}")
                    continue
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if any(n.replace(".", "/").removeprefix("autofit/") in ADAPTERS for n in names):
                    continue
                other = node.module.split(".")[1] if "." in node.module else ""
                if other in rank and rank[other] > rank[layer] and (module, other) not in EXCEPTIONS:
                    wrong.append(f"{module} imports {node.module}")
    assert wrong == []


# No import cycle is left: the estimator's front (`estimate`: which walk to take) is split from the
# fake walk (`walk`), which the walks built on it (sampled, tiling, traced, sharded) import.
KNOWN_CYCLES = []


def _imports_of(path: pathlib.Path, modules: set) -> set:
    """The autofit modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autofit"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autofit")}
    return found & modules


def import_cycles() -> list[list[str]]:
    """Each set of autofit modules that import one another in a circle (strongly connected, sorted)."""
    paths = {".".join(("autofit",) + p.relative_to(ROOT / "autofit").with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "autofit").rglob("*.py")}
    graph = {m: _imports_of(p, set(paths)) - {m, "autofit"} for m, p in paths.items()}
    reach = {m: set() for m in graph}
    for start in graph:  # every module each one reaches (the graph is small: a walk from each)
        stack = list(graph[start])
        while stack:
            m = stack.pop()
            if m not in reach[start]:
                reach[start].add(m)
                stack.extend(graph[m])
    cycles = {tuple(sorted(m for m in graph if m in reach[start] and start in reach[m])) for start in graph}
    return sorted(list(c) for c in cycles if c)


def test_no_import_cycle_but_the_estimators_known_one():
    assert import_cycles() == KNOWN_CYCLES


def test_the_layout_names_every_module():
    """docs/contributing.md's Layout says each module's concept: a module added without a word there
    is found here."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    layout = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
    named = set(re.findall(r"`(?:\w+/)?(\w+)(?:\.py)?`", layout))
    modules = [p for p in sorted((ROOT / "autofit").rglob("*.py")) if p.name != "__init__.py"]
    assert [str(p.relative_to(ROOT)) for p in modules if p.stem not in named] == []
