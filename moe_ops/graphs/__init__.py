"""``moe_ops.graphs`` in a plain checkout: loads the repository's top-level ``graphs/`` folder as it.

The wheel and an editable install never use this file: pyproject.toml maps the package
``moe_ops.graphs`` to ``graphs/`` (``package-dir``), so their ``moe_ops/graphs/__init__.py`` is
``graphs/__init__.py`` itself. With the checkout on ``PYTHONPATH`` and nothing installed, Python
finds this file instead; it executes ``graphs/__init__.py`` as the module ``moe_ops.graphs``, with
``graphs/`` as its search path, so ``moe_ops.graphs.runner`` is ``graphs/runner.py`` and the
relative imports resolve inside ``moe_ops``. A ``graphs/`` folder in the working directory is never
looked at.
"""

import importlib.util
import sys
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[2] / "graphs"
_spec = importlib.util.spec_from_file_location(
    __name__, _SOURCE / "__init__.py", submodule_search_locations=[str(_SOURCE)]
)
_module = importlib.util.module_from_spec(_spec)
# the import system returns sys.modules[__name__] once this file has run: the real package
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
