"""docs/architecture.md cannot drift from the code silently: its package picture has the arrows the import graph has
(:func:`test_layers.import_graph`, collapsed to packages), its layout names every module that exists and none that
does not, and its "add a drafter" / "add an engine" examples are run: their code blocks registered as written, then
chosen by name through :func:`medusa.build.build_model`, decoding exactly the base's greedy tokens.

``python tests/test_architecture_doc.py`` prints the picture's block from the code, to paste into the doc.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_decoding import hf_greedy
from test_layers import import_graph, module_files
from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SUBPACKAGES = ("decode", "engines", "drafters", "io", "tools", "serve")
"""The subpackages of ``medusa`` drawn as one box each; ``train`` is one box; every other module is its own box."""
PICTURE = "The packages and their arrows"
ADD_DRAFTER, ADD_ENGINE = "Add a drafter", "Add an engine"


def unit(module: str) -> str:
    """The box of the picture ``module`` belongs to: ``train``, ``medusa.<subpackage>``, or the module itself."""
    parts = module.split(".")
    if parts[0] == "train":
        return "train"
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return ".".join(parts[:2])
    return module


def box_id(box: str) -> str:
    """The mermaid node id of a box (``medusa.decode`` -> ``decode``, ``medusa`` -> ``medusa``)."""
    return box.removeprefix("medusa.").lstrip("_") or box


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{box: boxes it imports}`` over every box, imports inside functions included, arrows within a box left out."""
    arrows: dict[str, set[str]] = {}
    for module, imported in import_graph(root).items():
        arrows.setdefault(unit(module), set()).update(unit(m) for m in imported)
    return {box: targets - {box} for box, targets in arrows.items()}


def mermaid(graph: dict[str, set[str]]) -> str:
    """The picture's mermaid block: the boxes, four to a line, then per box one line of arrows to all it imports."""
    lines = ["```mermaid", "graph LR"]
    boxes = [f"{box_id(box)}[{box}]" for box in sorted(graph)]
    lines += ["  " + "; ".join(boxes[i : i + 4]) for i in range(0, len(boxes), 4)]
    lines += [f"  {box_id(box)} --> {' & '.join(box_id(t) for t in sorted(targets))}"
              for box, targets in sorted(graph.items()) if targets]
    return "\n".join([*lines, "```"])


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section of the doc (to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"docs/architecture.md has no section '## {heading}'"
    return match.group(1)


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the ``language`` fenced blocks in ``text``."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def doc_graph(text: str) -> dict[str, set[str]]:
    """The boxes and arrows the doc's mermaid block draws: ``{box label: labels it points to}``."""
    (block,) = fenced(section(text, PICTURE), "mermaid")
    labels = dict(re.findall(r"([\w.]+)\[([\w.]+)\]", block))
    graph = {label: set() for label in labels.values()}
    for source, targets in re.findall(r"^\s*([\w.]+)\s*-->\s*(.+?)\s*$", block, flags=re.M):
        graph[labels[source]] |= {labels[t.strip()] for t in targets.split("&")}
    return graph


def test_the_picture_has_the_arrows_the_code_has():
    code, doc = package_graph(), doc_graph(DOC.read_text(encoding="utf-8"))
    assert len(code) > 10 and "medusa.decode" in code["medusa.model"]
    pairs = {(a, b) for a, targets in code.items() for b in targets}
    drawn = {(a, b) for a, targets in doc.items() for b in targets}
    assert doc == code, (f"docs/architecture.md's package picture differs from the code's imports: boxes missing "
                         f"{sorted(set(code) - set(doc))}, extra {sorted(set(doc) - set(code))}; arrows missing "
                         f"{sorted(pairs - drawn)}, extra {sorted(drawn - pairs)}. Paste this "
                         f"(python tests/test_architecture_doc.py):\n{mermaid(code)}")


def test_the_picture_check_sees_a_new_arrow(tmp_path):
    """The collapsing at work on a made-up tree: an import inside a function between two subpackages is an arrow
    between their boxes, one within a box is none."""
    for folder in ("medusa/decode", "medusa/engines", "train"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "medusa" / "__init__.py").write_text("")
    (tmp_path / "medusa" / "decode" / "loop.py").write_text("def f():\n    from medusa.engines import base\n")
    (tmp_path / "medusa" / "engines" / "base.py").write_text("from medusa.engines import eager\n")
    (tmp_path / "medusa" / "engines" / "eager.py").write_text("")
    graph = package_graph(tmp_path)
    assert graph["medusa.decode"] == {"medusa.engines"} and graph["medusa.engines"] == set()
    assert doc_graph(f"## {PICTURE}\n{mermaid(graph)}\n") == graph


def test_the_layout_names_every_module_and_only_those():
    (block,) = fenced(section(DOC.read_text(encoding="utf-8"), "Layout"), "text")
    listed = re.findall(r"^((?:medusa|train)/[\w/]+\.py)\b", block, flags=re.M)
    exists = {str(path.relative_to(ROOT)) for path, _ in module_files().values()}
    assert not set(listed) - exists, f"the layout lists modules that do not exist: {sorted(set(listed) - exists)}"
    missing = {p for p in exists - set(listed) if not p.endswith("__init__.py")}
    assert not missing, f"the layout leaves out modules: {sorted(missing)}"
    assert len(listed) == len(set(listed)), "a module is listed twice"


@pytest.fixture
def doc_plugins():
    """The doc's two examples executed as written, in one namespace; their registrations undone afterwards (a
    registry refuses a name claimed twice). Yields ``(drafter name, engine name, namespace)``."""
    import medusa.drafters.draft_model  # noqa: F401  (every built-in drafter registered before the diff)
    from medusa.drafters import base as drafters_base
    from medusa.engines import ENGINES

    text = DOC.read_text(encoding="utf-8")
    blocks = {heading: fenced(section(text, heading), "python") for heading in (ADD_DRAFTER, ADD_ENGINE)}
    assert all(blocks.values()), "each worked example needs a python block"
    drafters, engines = set(drafters_base._DRAFTERS), set(ENGINES)
    namespace: dict = {}
    try:
        for heading, code in blocks.items():
            exec(compile("\n".join(code), f"docs/architecture.md ({heading})", "exec"), namespace)  # noqa: S102
        (drafter,), (engine,) = set(drafters_base._DRAFTERS) - drafters, set(ENGINES) - engines
        yield drafter, engine, namespace
    finally:
        for name in set(drafters_base._DRAFTERS) - drafters:
            drafters_base._DRAFTERS.pop(name)
        for name in set(ENGINES) - engines:
            ENGINES.pop(name)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("architecture-doc") / "base", "llama")


def looping_ids(seed: int = 7) -> torch.Tensor:
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids, ids[:5]])


@pytest.mark.parametrize("engine", ["doc", "static"])
def test_the_worked_examples_decode_exactly_through_the_model_builder(doc_plugins, folder, engine):
    from medusa.build import DecodeConfig, build_model

    drafter_name, engine_name, _ = doc_plugins
    engine_name = engine_name if engine == "doc" else engine
    model = build_model(DecodeConfig(base=str(folder), drafter=drafter_name, engine=engine_name))
    assert model.drafter.name == drafter_name and model.engine.name == engine_name
    ids = looping_ids()
    out, stats = model.generate(ids, 40, stop_token_ids=set())
    assert out == hf_greedy(model.base, ids, 40)
    assert stats.tau > 1.0  # the drafter's chains are accepted on text that repeats
    if engine == "doc":  # the prefill over the prompt, then one forward over each step's whole tree
        assert model.engine.sizes == [len(ids)] + [model.drafter.max_nodes] * stats.decode_steps


def test_the_worked_examples_decode_several_rows_in_one_forward(doc_plugins, folder):
    from medusa.build import DecodeConfig, build_model

    drafter_name, engine_name, _ = doc_plugins
    model = build_model(DecodeConfig(base=str(folder), drafter=drafter_name, engine=engine_name))
    prompts = [looping_ids(7), looping_ids(8)[:15]]
    outs, _ = model.generate_batch(prompts, 24, stop_token_ids=set())
    assert outs == [hf_greedy(model.base, p, 24) for p in prompts]


if __name__ == "__main__":
    print(mermaid(package_graph()))  # noqa: T201


def test_every_source_file_the_docs_name_exists():
    """A module moved by a refactor leaves its old path in prose; the old import path still works (``medusa._moved``),
    so nothing else would notice. Every `medusa/...`, `train/...`, `scripts/...`, `studies/...` and `tests/...` file
    named in backticks in the README, docs/ and the model cards must exist, and so must every committed config,
    prompt set, result and card they name (``tests/T.py`` is bad-inputs.md's placeholder for a test file)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "checkpoints").glob("*/README.md"))]
    span = re.compile(r"`([^`\n]+)`")
    pattern = re.compile(r"(?<![\w/.-])((?:medusa|train|scripts|studies|tests|configs|benchmarks|checkpoints|datasets"
                         r"|docs)/[\w./-]*?\.(?:py|c|sh|yaml|jsonl|json|md|png|xz|txt|safetensors))(?![\w.-])")
    named = [(f"{page.relative_to(ROOT)}:{number}", path) for page in pages
             for number, line in enumerate(page.read_text().splitlines(), 1)
             for code in span.findall(line) for path in pattern.findall(code)]
    assert len({path for _, path in named}) > 100  # the pattern finds what the pages name
    assert [f"{where}: {path}" for where, path in named if path != "tests/T.py" and not (ROOT / path).exists()] == []
