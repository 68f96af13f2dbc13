"""examples/quickstart.ipynb runs top to bottom, offline, on the tiny checkpoint: each code
cell in order in one IPython shell (its magics and display formatters, as a kernel runs
them), in this process, where blockscope is already imported."""

import matplotlib
import nbformat
from IPython.core.interactiveshell import InteractiveShell

from ..conftest import REPO


class Shell(InteractiveShell):
    """IPython's shell as a kernel has it: `%matplotlib inline` needs no GUI loop."""

    def enable_gui(self, gui=None):
        pass


def test_the_quickstart_notebook_runs_offline(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSCOPE_EXAMPLE_MODEL", str(tiny_dir))
    monkeypatch.setenv("BLOCKSCOPE_EXAMPLE_TOKENS", "40")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    shell = Shell.instance()
    shown = []
    try:
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            run = shell.run_cell(cell.source, store_history=False)
            assert run.success, (cell.source, run.error_in_exec or run.error_before_exec)
            if run.result is not None:
                shown.append(shell.display_formatter.format(run.result)[0])
    finally:
        Shell.clear_instance()
        matplotlib.use("Agg")  # as the rest of the suite draws
    assert sum("image/png" in bundle for bundle in shown) == 2  # both figures drawn
    assert any("blockscope ablate" in bundle.get("text/html", "") for bundle in shown)
    assert len(list((tmp_path / "results").glob("ablate-*.csv"))) == 1


def test_the_notebook_and_the_docs_use_the_public_face_only():
    """`import blockscope as bs` and `bs.<name>` of `bs.__all__`: nothing else of blockscope."""
    import re

    import blockscope as bs

    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    texts = ["\n".join(c.source for c in nb.cells if c.cell_type == "code"),
             *re.findall(r"```python\n(.*?)```", (REPO / "docs" / "python.md").read_text()
                         + (REPO / "README.md").read_text(), re.S)]
    for text in texts:
        assert re.findall(r"^[ \t]*(?:import|from) blockscope\b.*$", text, re.M) == [
            "import blockscope as bs"]
        assert set(re.findall(r"\bbs\.(\w+)", text)) <= set(bs.__all__)
