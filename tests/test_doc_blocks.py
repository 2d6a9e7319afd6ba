"""Every code block of README.md and docs/**/*.md runs in the tests: a block whose marker
names a test is that test's (which must read the page), and this file runs the others. A
Python block runs in a fresh folder; a YAML block is a pipeline, or sections of one, that the
schema accepts (each section put in place of the quickstart's); a shell line is a `make`
target the Makefile has or a `raydp-train` command its parser takes. The README stays short:
at most 250 lines, the quickstart pipeline shown as it is, no measurement history, every
link to a file that exists."""

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml
from doc_blocks import ROOT, Block, all_blocks, blocks, marked_block

from raydp_train.commands.cli import _parser
from raydp_train.config.pipeline import Pipeline

README = ROOT / "README.md"
LANGUAGES = {"python", "yaml", "bash", "text"}
UNMARKED = [block for block in all_blocks() if block.marker is None]
SHELL_SET_UP = ("git clone", "cd ", "source ")


def _ids(found: list[Block]) -> list[str]:
    return [f"{block.page}:{block.line}" for block in found]


def test_the_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move the detail into docs/"


def test_the_readme_shows_the_quickstart_pipeline_as_it_is():
    shown = marked_block("README.md", "quickstart")
    assert shown == (ROOT / "pipelines" / "quickstart.yaml").read_text()


def test_the_readme_tells_no_history_and_links_only_files_that_exist():
    text = README.read_text()
    history = re.findall(r"\b(?:session|issue) \d+|(?<![\d.])0\.[1-9]\.\d(?![\d.])|\bonce was\b|\bused to\b",
                         text, re.IGNORECASE)
    assert not history, f"history belongs in CHANGELOG.md, measurements in RESULTS.md: {history}"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) > 20
    missing = [link for link in links if not link.startswith("http")
               and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_block_has_a_language_and_a_test_that_runs_it():
    found = all_blocks()
    assert {block.page for block in found} >= {"README.md", "docs/guides/own-model.md",
                                               "docs/reference/pipeline.md"}
    no_language = [str(b) for b in found if b.language not in LANGUAGES]
    assert not no_language, f"blocks without a language this test knows: {no_language}"
    unclaimed = [str(b) for b in found if b.language == "text" and b.marker is None]
    assert not unclaimed, f"text blocks (outputs) need a marker naming their test: {unclaimed}"
    for block in found:
        if block.test_file is not None:
            test = ROOT / block.test_file
            assert test.exists(), f"{block}: its marker names {block.test_file}, which is gone"
            assert block.page in test.read_text() or (
                block.page == "README.md" and "README" in test.read_text()), (
                f"{block}: {block.test_file} does not read {block.page}")


def _quickstart() -> dict:
    return yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())


@pytest.mark.parametrize("block", [b for b in UNMARKED if b.language == "yaml"],
                         ids=_ids([b for b in UNMARKED if b.language == "yaml"]))
def test_each_yaml_block_is_a_pipeline_the_schema_takes(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(block.text)
    assert isinstance(raw, dict) and set(raw) <= set(Pipeline.model_fields), block
    pipeline = raw if "name" in raw else {**_quickstart(), **raw}
    if "tune" in pipeline and "budget" not in pipeline:
        pytest.fail(f"{block}: a sweep needs a budget")
    Pipeline.from_dict(pipeline)


def _prepare(block: Block, folder: Path) -> None:
    """The files a block reads, made small: GLUE's TSVs for the SST-2 conversion."""
    if "SST-2/" in block.text:
        (folder / "SST-2").mkdir()
        (folder / "sst2").mkdir()
        for split in ("train", "dev"):
            (folder / "SST-2" / f"{split}.tsv").write_text(
                "sentence\tlabel\na fine film\t1\na dull one\t0\n")


@pytest.mark.parametrize("block", [b for b in UNMARKED if b.language == "python"],
                         ids=_ids([b for b in UNMARKED if b.language == "python"]))
def test_each_python_block_runs(block, tmp_path, monkeypatch):
    from raydp_train.privacy import clipping, rule_registry  # noqa: F401 -- clipping: the built-in rules

    monkeypatch.chdir(tmp_path)
    # A block may register a rule of its own: it is gone after the test. The built-in rules
    # are registered before the copy (imported first inside it, they would go with it).
    monkeypatch.setattr(rule_registry, "_RULES", dict(rule_registry._RULES))
    _prepare(block, tmp_path)
    exec(compile(block.text, block.page, "exec"), {"__name__": "doc_block"})  # noqa: S102


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _commands(text: str) -> list[str]:
    lines = text.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("block", [b for b in UNMARKED if b.language == "bash"],
                         ids=_ids([b for b in UNMARKED if b.language == "bash"]))
def test_each_shell_line_is_a_command_that_exists(block):
    parser = _parser()
    for command in _commands(block.text):
        for part in (p.strip() for p in command.split("&&")):
            words = shlex.split(part)
            if part.startswith(SHELL_SET_UP):
                continue
            if words[0] == "make":
                assert set(words[1:]) <= _make_targets(), f"{block}: {part}"
            elif words[0].endswith("raydp-train"):
                parser.parse_args(words[1:])  # exits (SystemExit) on anything it lacks
            else:
                pytest.fail(f"{block}: no test runs `{part}`; give the block a marker")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (found,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found.choices)


def test_the_command_synopsis_names_only_commands_and_options_the_parser_has():
    synopsis = marked_block("docs/reference/cli.md", "synopsis")
    commands = _subcommands(_parser())
    seen = set()
    current = None
    for line in synopsis.splitlines():
        usage = line.split("  #", 1)[0]
        if usage.startswith("raydp-train "):
            words = usage.split()
            current = commands[words[1]]
            if words[1] == "budget":
                current = _subcommands(current)[words[2]]
            seen.add(words[1])
        options = set(re.findall(r"(--[\w-]+)", usage))
        known = {o for action in current._actions for o in action.option_strings}
        assert options <= known, f"{line.strip()}: not options of the parser: {options - known}"
    assert seen == set(commands), f"commands the synopsis leaves out: {set(commands) - seen}"


def test_the_cluster_guide_shows_the_readmes_walkthrough():
    assert marked_block("docs/guides/cluster.md", "cluster walkthrough") == marked_block(
        "README.md", "cluster walkthrough")


def test_a_block_and_its_marker_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- demo: tests/test_x.py runs it -->\n```python\nx = 1\n```\n\n"
                    "```yaml\na: 1\n```\n")
    first, second = blocks(page, root=tmp_path)
    assert (first.language, first.text, first.marker, first.test_file) == (
        "python", "x = 1\n", "demo", "tests/test_x.py")
    assert (second.language, second.marker, second.line) == ("yaml", None, 8)



def test_the_cluster_sections_say_how_to_submit_from_another_machine():
    """The job server listens on loopback unless the head is started with --dashboard-host."""
    readme = README.read_text().split("## A cluster", 1)[1].split("\n## ", 1)[0]
    guide = (ROOT / "docs" / "guides" / "cluster.md").read_text()
    for text in (readme, guide):
        assert "--dashboard-host 0.0.0.0" in text and "another machine" in text


def test_the_design_page_is_architecture_md_up_to_its_module_map():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "repository_pages", ROOT / "docs" / "hooks" / "repository_pages.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    design = hook.design()
    architecture = (ROOT / "ARCHITECTURE.md").read_text()
    assert design.startswith(architecture.split("\n## 3. ", 1)[0].rstrip())
    assert "\n## 2. The math" in design and "\n## 3. " not in design
