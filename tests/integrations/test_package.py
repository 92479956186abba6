"""stallfree.integrations is optional: importing it loads no framework, and a submodule whose
framework is missing says in one line what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_package_imports_no_framework_and_no_torch():
    out = _python(
        "import sys, stallfree, stallfree.integrations\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("framework", ["transformers", "accelerate"])
def test_a_missing_framework_is_one_importerror_line_naming_what_to_install(framework):
    out = _python(
        f"import sys; sys.modules[{framework!r}] = None\n"  # as if it were not installed
        "try:\n"
        f"    import stallfree.integrations.{framework}\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc, sep=': ')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"MissingExtra: stallfree.integrations.{framework} needs {framework}: pip install 'stallfree[hf]' "
        "(or: pip install 'transformers>=5.25' 'accelerate>=1.16')"
    )


def test_submodules_resolve_lazily_and_unknown_names_are_attribute_errors():
    import stallfree.integrations as integrations

    assert integrations.state_file.STATE_FILE == "stallfree_loader_state.json"
    with pytest.raises(AttributeError, match="no attribute 'lightning'"):
        integrations.lightning  # noqa: B018
