"""ARCHITECTURE.md stays the document the code cites: every "ARCHITECTURE.md §N" in the
repository names a section that exists, no citation of the old out-of-repository design
document is left, the module map names exactly the modules of raydp_train/, the privacy
math keeps the rule the map states (no Ray, no YAML, no pipeline schema), and the layout
stays readable: no import cycle among the package's modules, no import from a layer up to a
higher one (the order the map states), no module over 300 lines, no function over 60, no
stop reason matched by its text."""

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOC = ROOT / "ARCHITECTURE.md"
PACKAGE = ROOT / "raydp_train"
# Built from pieces so that this file does not cite anything itself.
CITATION = re.compile("ARCHITECTURE" + r"\.md §(\d+(?:\.\d+)*)(?:-(\d+(?:\.\d+)*))?")
SECTION_REFERENCE = re.compile(r"§(\d+(?:\.\d+)*)(?:-(\d+(?:\.\d+)*))?")
OLD_CITATION = "DESIGN" + " §"
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
FORBIDDEN_IN_PRIVACY = {"ray", "yaml", "pydantic"}
# The privacy math: the engine, epsilon, and the budget's book and ledger (not its Ray actor).
MATH_PACKAGES = ("privacy", "accounting", "budget")
NOT_MATH = {"budget/actor.py"}
# Outside them, the privacy math may import only the leaf module of the user-error base.
ALLOWED_IN_PRIVACY = {"raydp_train.errors"}
# The package's root is its public surface; every other module sits in its concept's package.
PUBLIC_SURFACE = {"__init__.py", "__main__.py", "api.py", "errors.py"}
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60  # a function read on one screen
# A stop reason read back from its text (the StopReason enum is compared instead).
TEXT_MATCHED_STOP = re.compile(
    r"stop(?:_reason)?\W*\]?\.(?:startswith|split)\(|"
    r"startswith\(\(?\"(?:interrupted|budget exhausted|target epsilon|reservation used up)")


def section_numbers(doc: str) -> set[str]:
    return set(HEADING.findall(doc))


def cited_sections(text: str, pattern: re.Pattern = CITATION) -> set[str]:
    """Every section a text cites; a range "§2.1-2.2" cites both ends."""
    return {number for match in pattern.findall(text) for number in match if number}


def module_map(doc: str) -> str:
    """The text of section 3, from its heading to the next top-level section."""
    return ("\n" + doc).split("\n## 3. ", 1)[1].split("\n## ", 1)[0]


def mapped_modules(doc: str) -> set[str]:
    """The modules the map's table rows name, each in the row's first cell."""
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", module_map(doc), re.MULTILINE))


def package_modules(package: Path) -> set[str]:
    return {path.relative_to(package).as_posix() for path in package.rglob("*.py")
            if path.name != "__init__.py"}


def repository_files() -> list[Path]:
    """The repository's .py, .md and .yaml files, without hidden folders (.venv, .git) and
    build outputs."""
    skip = {"build", "dist", "__pycache__", "node_modules"}
    found = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not (
            name.startswith(".") or name in skip or name.endswith(".egg-info"))]
        found += [Path(folder, name) for name in names if name.endswith((".py", ".md", ".yaml"))]
    return sorted(found)


def missing_citations(files: list[Path], sections: set[str], root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)}: §{number}" for path in files
            for number in sorted(cited_sections(path.read_text(errors="replace")) - sections)]


def imports_outside_the_rule(source: str) -> set[str]:
    """Modules a privacy module imports that the rule forbids."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name for name in names
            if name.split(".")[0] in FORBIDDEN_IN_PRIVACY
            or (name.split(".")[0] == "raydp_train" and name not in ALLOWED_IN_PRIVACY
                and (name.split(".")[1:2] or [""])[0] not in MATH_PACKAGES)
            or name == "raydp_train.budget.actor"}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. Imports inside functions count too: a lazy
    import still ties the two modules together (and only hides a cycle until it runs); so do
    imports under `if TYPE_CHECKING`, which none of the package needs."""
    files = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from this package, up level - 1 packages
                    parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                # `from a import b`: b is a module of the package, or a name defined in a
                found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                          for alias in node.names}
        graph[name] = {other for other in found if other in files and other != name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as [a, b, ..., a], or [] if it has none (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = "open"
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        state[name] = "done"
        path.pop()
        return []

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return []


def test_every_citation_names_an_existing_section():
    sections = section_numbers(DOC.read_text())
    missing = missing_citations(repository_files(), sections)
    assert not missing, f"citations of sections ARCHITECTURE.md does not have: {missing}"


def test_the_document_cites_only_its_own_sections():
    doc = DOC.read_text()
    missing = cited_sections(doc, SECTION_REFERENCE) - section_numbers(doc)
    assert not missing, f"ARCHITECTURE.md refers to sections it does not have: {sorted(missing)}"


def test_no_citation_of_the_old_design_document_remains():
    stale = [str(path.relative_to(ROOT)) for path in repository_files()
             if OLD_CITATION in path.read_text(errors="replace")]
    assert not stale, f"cite ARCHITECTURE.md instead of the old design document in: {stale}"


def test_the_module_map_names_exactly_the_package_modules():
    mapped, modules = mapped_modules(DOC.read_text()), package_modules(PACKAGE)
    assert not modules - mapped, f"modules missing from the map: {sorted(modules - mapped)}"
    assert not mapped - modules, f"the map names modules that are gone: {sorted(mapped - modules)}"


LAYER_LINE = re.compile(r"^(\d+)\. (?:[\w ]+: )?(.+)$", re.MULTILINE)


def layers(doc: str) -> dict[str, int]:
    """Module pattern -> its layer (1 = lowest), from the map's numbered layer list."""
    return {pattern: int(number) for number, names in LAYER_LINE.findall(module_map(doc))
            for pattern in re.findall(r"`([\w/*]+)`", names)}


def layer_of(module: str, order: dict[str, int]) -> int | None:
    """`raydp_train.train.worker` is `train/worker`, in the layer of `train/*`."""
    path = "raydp_train" if module == "raydp_train" else module.removeprefix(
        "raydp_train.").replace(".", "/")
    folder = path.rpartition("/")[0]
    # A folder's __init__ is in the folder's layer.
    return order.get(path, order.get(f"{folder}/*" if folder else f"{path}/*"))


def upward_imports(graph: dict[str, set[str]], order: dict[str, int]) -> list[str]:
    """Imports from a lower layer up to a higher one, and modules no layer names."""
    unplaced = [f"{module}: in no layer" for module in sorted(graph)
                if layer_of(module, order) is None]
    upward = [f"{module} (layer {layer_of(module, order)}) imports {other} (layer "
              f"{layer_of(other, order)})" for module in sorted(graph) for other in
              sorted(graph[module]) if None not in (layer_of(module, order),
                                                    layer_of(other, order))
              and layer_of(other, order) > layer_of(module, order)]
    return unplaced + upward


def test_the_root_holds_only_the_public_surface():
    root = {path.name for path in PACKAGE.glob("*.py")}
    assert root == PUBLIC_SURFACE, (f"move {sorted(root - PUBLIC_SURFACE)} into the package of "
                                    "its concept (ARCHITECTURE.md §3)")
    assert all((folder / "__init__.py").exists() for folder in PACKAGE.iterdir()
               if folder.is_dir() and folder.name != "__pycache__")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout: asks git "
                    "which files a clone would lack")
@pytest.mark.slow
def test_git_ignores_no_module_of_the_package():
    # A clean clone lacked raydp_train/runs/__init__.py once: .gitignore's "runs/" (meant for
    # run output) matched the package of that name.
    modules = [str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *modules], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.split()
    assert not ignored, f"git would leave these out of a clone; fix .gitignore: {ignored}"


def test_no_module_imports_up_from_a_lower_layer():
    problems = upward_imports(import_graph(PACKAGE), layers(DOC.read_text()))
    assert not problems, f"against the layer order of ARCHITECTURE.md §3: {problems}"


def test_each_layer_is_one_folder_or_one_root_module():
    lines = LAYER_LINE.findall(module_map(DOC.read_text()))
    entries = [re.findall(r"`([\w/*]+)`", names) for _, names in lines]
    not_one = [names for names in entries if len(names) != 1]
    assert not not_one, f"one folder (or root module) per layer line: {not_one}"
    modules_named = [name for (name,) in entries if "/" in name and not name.endswith("/*")]
    assert not modules_named, f"name the folder, not its modules: {modules_named}"
    folders = {path.name for path in PACKAGE.iterdir()
               if path.is_dir() and path.name != "__pycache__"}
    assert folders == {name[:-2] for (name,) in entries if name.endswith("/*")}


def test_an_upward_import_and_an_unplaced_module_are_caught():
    doc = ("## 3. Module map\n1. base: `errors`\n2. math: `privacy/*`\n"
           "3. top: `cli`, `api`\n## 4. Next\n")
    order = layers(doc)
    assert order == {"errors": 1, "privacy/*": 2, "cli": 3, "api": 3}
    graph = {"raydp_train.errors": {"raydp_train.privacy.noise"},
             "raydp_train.privacy.noise": {"raydp_train.errors"},
             "raydp_train.cli": {"raydp_train.api", "raydp_train.privacy.noise"},
             "raydp_train.api": set(), "raydp_train.new": set(), "raydp_train.privacy": set()}
    assert upward_imports(graph, order) == [
        "raydp_train.new: in no layer",
        "raydp_train.errors (layer 1) imports raydp_train.privacy.noise (layer 2)"]


def math_modules(package: Path = PACKAGE) -> list[Path]:
    return [path for folder in MATH_PACKAGES for path in sorted((package / folder).rglob("*.py"))
            if path.relative_to(package).as_posix() not in NOT_MATH]


def test_the_privacy_math_imports_no_ray_yaml_or_schema():
    assert len(math_modules()) >= 25  # the three packages are there
    broken = {str(path.relative_to(ROOT)): sorted(found) for path in math_modules()
              if (found := imports_outside_the_rule(path.read_text()))}
    assert not broken, f"{MATH_PACKAGES} must not import Ray, YAML or the schema: {broken}"


def test_the_rule_catches_ray_the_schema_and_the_actor():
    assert imports_outside_the_rule("import ray\nfrom raydp_train.budget.ledger import x\n") == {"ray"}
    assert imports_outside_the_rule("from raydp_train.config.pipeline import P\n") == {
        "raydp_train.config.pipeline"}
    assert imports_outside_the_rule("from raydp_train.budget.actor import open_budget\n") == {
        "raydp_train.budget.actor"}
    assert not imports_outside_the_rule("from raydp_train.accounting.epsilon import e\n"
                                        "from raydp_train.errors import UserError\n")


def test_no_import_cycle_among_the_package_modules():
    cycle = import_cycle(import_graph(PACKAGE))
    assert not cycle, (f"import cycle: {' -> '.join(cycle)}; move the shared piece so the "
                       "dependency goes one way")


def test_no_module_is_over_300_lines():
    long = {str(path.relative_to(ROOT)): lines for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions and methods (docstring and body) longer than `limit` lines, by place."""
    return {f"{path.relative_to(package)}:{node.name}": lines
            for path in sorted(package.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (lines := node.end_lineno - node.lineno + 1) > limit}


def test_no_function_is_over_60_lines():
    long = long_functions(PACKAGE)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                      f"steps): {long}")


def test_a_long_function_is_caught(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(60))  # + its def line: 61
    (tmp_path / "m.py").write_text("def short():\n    pass\n\n\nclass C:\n    def long(self):\n"
                                   + body)
    assert long_functions(tmp_path) == {"m.py:long": 61}


def stop_reasons_matched_by_text(package: Path) -> list[str]:
    return [f"{path.relative_to(package)}:{number}"
            for path in sorted(package.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if TEXT_MATCHED_STOP.search(line)]


def test_stop_reasons_are_compared_as_the_enum_never_by_their_text():
    found = stop_reasons_matched_by_text(PACKAGE)
    assert not found, f"compare raydp_train.train.stops.StopReason members instead: {found}"


def names_compared(package: Path, names, allowed=("privacy/mechanism.py",)) -> list[str]:
    """Lines outside the registries that compare a value with one of `names` (==, !=, in,
    case): the code should ask the registered object what it is instead."""
    quoted = "|".join(re.escape(name) for name in names)
    compared = re.compile(rf"(?:==|!=|\bin|\bcase)\s*[(\[{{]?\s*[\"']({quoted})[\"']|"
                          rf"[\"']({quoted})[\"']\s*(?:==|!=|in\b)")
    return [f"{path.relative_to(package)}:{number}"
            for path in sorted(package.rglob("*.py")) if path.relative_to(package).as_posix()
            not in allowed for number, line in enumerate(path.read_text().splitlines(), 1)
            if compared.search(line)]


def test_no_mechanism_or_task_name_is_compared_outside_the_registries():
    from raydp_train.config.model import TASK_HAS_LABELS
    from raydp_train.privacy.mechanism import MECHANISMS

    names = [*MECHANISMS, *TASK_HAS_LABELS]
    assert {"dpsgd", "lsg", "lora", "none", "causal_lm"} <= set(names)
    found = names_compared(PACKAGE, names)
    assert not found, f"ask the mechanism or task object, not its name: {found}"


# The checks themselves catch what they are for.

def test_a_compared_mechanism_or_task_name_is_caught(tmp_path):
    (tmp_path / "a.py").write_text('if privacy.mechanism == "none":\n    x = 1\n'
                                   'y = task != "causal_lm"\nz = kind in ("lsg", "lora")\n'
                                   'w = "none" if q else "lsg"\nmechanism: str = "dpsgd"\n')
    assert names_compared(tmp_path, ["none", "causal_lm", "lsg", "lora", "dpsgd"]) == [
        "a.py:1", "a.py:3", "a.py:4"]

def test_a_stop_reason_matched_by_its_text_is_caught(tmp_path):
    (tmp_path / "cli.py").write_text('if result.stop_reason.startswith("interrupted"):\n'
                                     "    stop = result['stop_reason'].split(':')[0]\n")
    assert stop_reasons_matched_by_text(tmp_path) == ["cli.py:1", "cli.py:2"]



def test_a_citation_of_a_missing_section_is_caught(tmp_path):
    cited = tmp_path / "module.py"
    cited.write_text('"""See ' + "ARCHITECTURE" + '.md §2.1-2.9 and §7."""\n')
    assert missing_citations([cited], {"2", "2.1", "2.2"}, tmp_path) == ["module.py: §2.9"]


def test_a_module_without_a_map_entry_is_caught(tmp_path):
    (tmp_path / "privacy").mkdir()
    for name in ("__init__.py", "cli.py", "privacy/__init__.py", "privacy/new_mechanism.py"):
        (tmp_path / name).write_text("")
    doc = "## 3. Module map\n| `cli.py` | the command line |\n## 4. Next\n| `old.py` | |\n"
    assert package_modules(tmp_path) - mapped_modules(doc) == {"privacy/new_mechanism.py"}


def test_headings_and_forbidden_imports_are_read():
    doc = "## 2. The math\n### 2.1 Step\n#### 2.1.1 Detail\n## 10. Late\nnot # 3. a heading\n"
    assert section_numbers(doc) == {"2", "2.1", "2.1.1", "10"}
    source = ("import torch\nimport ray.train\nfrom raydp_train.config.pipeline import Pipeline\n"
              "from raydp_train.privacy.noise import noise_std\n"
              "def f():\n    import yaml\n")
    assert imports_outside_the_rule(source) == {"ray.train", "raydp_train.config.pipeline", "yaml"}
    assert imports_outside_the_rule("from raydp_train.errors import UserError\n") == set()


def test_an_import_cycle_is_caught_even_through_a_lazy_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {"__init__.py": "", "sub/__init__.py": "", "a.py": "from pkg.sub import b\n",
             "sub/b.py": "from . import c\n", "sub/c.py": "def f():\n    from pkg.a import x\n",
             "d.py": "import pkg.a\n"}
    for name, source in files.items():
        (package / name).write_text(source)
    graph = import_graph(package)
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert import_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (package / "sub/c.py").write_text("x = 1\n")
    assert import_cycle(import_graph(package)) == []


HISTORY = re.compile(r"\b(issue|session) \d+\b", re.IGNORECASE)


def history_mentions(paths, root: Path = ROOT) -> list[str]:
    """Where code, tests or docs say when or in which issue something came: the CHANGELOG
    and benchmarks/RESULTS.md keep history, nothing else."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_no_code_test_or_doc_tells_which_issue_or_session_it_came_from():
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"),
             *(ROOT / "docs").rglob("*.md"), ROOT / "README.md", DOC]
    assert not history_mentions([p for p in paths if p.name != "test_architecture_doc.py"])


def test_a_history_mention_is_caught(tmp_path):
    (tmp_path / "m.py").write_text('"""Added in issue 12."""\n')
    (tmp_path / "n.py").write_text('"""An issue, and 12 of them."""\n')
    assert history_mentions([tmp_path / "m.py", tmp_path / "n.py"], tmp_path) == ["m.py:1"]
